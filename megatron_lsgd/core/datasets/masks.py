"""Loss mask, position ids and attention mask for left-to-right LM samples."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch


def ltor_fields(tokens: np.ndarray, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                reset_attention_mask: bool) -> Dict[str, torch.Tensor]:
    """Fields derived from the input tokens of one sample.

    A document's EOD token belongs to that document; the token after it starts a new one.
    With reset_position_ids positions restart at 0 there, with reset_attention_mask no token
    attends across the boundary. The mask is bool [1, s, s], True = masked out (Megatron).
    """
    s = tokens.shape[0]
    is_eod = tokens == eod
    out: Dict[str, torch.Tensor] = {}
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    out["loss_mask"] = torch.from_numpy(loss_mask)

    segment = np.zeros(s, dtype=np.int64)
    if s > 1:
        np.cumsum(is_eod[:-1], out=segment[1:])
    positions = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        seg_start = np.flatnonzero(np.diff(segment, prepend=-1))  # first index of each segment
        positions = positions - seg_start[segment]
    out["position_ids"] = torch.from_numpy(positions)

    if reset_attention_mask:
        seg = torch.from_numpy(segment)
        allowed = torch.ones(s, s, dtype=torch.bool).tril_() & (seg[:, None] == seg[None, :])
        out["attention_mask"] = (~allowed).unsqueeze(0)
    return out
