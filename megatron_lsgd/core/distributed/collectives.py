"""Thin version-compat names for the flat-tensor collectives (torch renamed them in 2.13)."""

import torch.distributed as dist

# torch >= 2.13 names them *_single and deprecates the *_tensor spelling; keep both working.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
