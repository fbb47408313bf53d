"""This rank's model chunk, built and initialised from the run seed.

- On the host (`per_shard=False`, the default for a CPU run): the exact path the regression
  fixtures were recorded with. The provider builds the chunk on the host, and every
  parameter's full value is drawn there, its slice kept.
- On a GPU (`per_shard=True`, the default there): nothing full-size touches the host. The
  provider builds the chunk on the meta device; its parameters get storage on the run's
  device (`materialize_parameters`); each value is drawn on the host in pieces of at most
  `MAX_HOST_ELEMENTS` values, and only this rank's slice of each piece is copied to the
  device. Buffers (the rotary frequencies) are computed on the host at build time and
  moved. The values are the exact path's, bit for bit (core/tensor_parallel/initialize.py),
  which `tests/unit_tests/core/test_init_per_shard.py` checks on CPU through this same path.

Pipeline stages build only their own layers either way (the provider's pre/post_process).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_lsgd.core.tensor_parallel.initialize import MAX_HOST_ELEMENTS, materialize_parameters


def build_model(model_provider: Callable, config, pgs, rng_tracker, device: torch.device,
                per_shard: Optional[bool] = None, max_host_elements: int = MAX_HOST_ELEMENTS):
    if per_shard is None:
        per_shard = device.type != "cpu"

    def build():
        return model_provider(config, pgs, rng_tracker, pre_process=pgs.is_first_stage,
                              post_process=pgs.is_last_stage)

    seed = config.training.seed
    if not per_shard:
        model = build()
        model.to(device)
        model.initialize(seed)
        return model
    with torch.device("meta"):
        model = build()
    materialize_parameters(model, device)
    model.to(device)  # what the provider made on the host (buffers)
    model.initialize(seed, max_host_elements=max_host_elements)
    return model
