"""Point-to-point activation/gradient exchange between adjacent pipeline stages.

Paired operations (send one way, receive the other) go through one batch_isend_irecv so
neighbouring stages can never deadlock on send ordering.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_lsgd.core.parallel_state import ProcessGroups


class PipelineP2P:
    def __init__(self, pgs: ProcessGroups, tensor_shape: Sequence[int], dtype: torch.dtype, device: torch.device):
        self.pgs = pgs
        self.shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)

    def _run(self, send_prev: Optional[torch.Tensor], send_next: Optional[torch.Tensor],
             recv_prev: bool, recv_next: bool):
        ops = []
        from_prev = from_next = None
        prev = None if self.pgs.prev_stage_rank is None else self.pgs.world_rank(self.pgs.prev_stage_rank)
        nxt = None if self.pgs.next_stage_rank is None else self.pgs.world_rank(self.pgs.next_stage_rank)
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), prev))
        if recv_prev:
            from_prev = self._empty()
            ops.append(dist.P2POp(dist.irecv, from_prev.data, prev))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, nxt))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return from_prev, from_next

    def recv_forward(self) -> Optional[torch.Tensor]:
        return None if self.pgs.is_first_stage else self._run(None, None, True, False)[0]

    def send_forward(self, output: torch.Tensor) -> None:
        if not self.pgs.is_last_stage:
            self._run(None, output, False, False)

    def recv_backward(self) -> Optional[torch.Tensor]:
        return None if self.pgs.is_last_stage else self._run(None, None, False, True)[1]

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        if not self.pgs.is_first_stage:
            self._run(input_grad, None, False, False)

    def send_forward_recv_backward(self, output: torch.Tensor) -> Optional[torch.Tensor]:
        if self.pgs.is_last_stage:
            return None
        return self._run(None, output, False, True)[1]

    def send_backward_recv_forward(self, input_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.pgs.is_first_stage:
            return None
        return self._run(input_grad, None, True, False)[0]
