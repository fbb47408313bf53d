"""Cross entropy over logits split by vocabulary across tensor-parallel ranks.

The full logits are never gathered: each rank reduces max, sum(exp) and the target logit
over its own vocabulary slice, and three small all-reduces finish the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group):
        # One fp32 [s, b, V/tp] buffer: shifted logits, then exp in place, then the softmax
        # saved for backward, which turns it into the gradient in place.
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        part = logits.shape[-1]
        start = rank * part

        logits_max = logits.max(dim=-1).values.float()
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        if logits.dtype == torch.float32:
            shifted = logits - logits_max.unsqueeze(-1)  # never in place on the autograd input
        else:
            shifted = logits.float().sub_(logits_max.unsqueeze(-1))  # the cast's copy is ours

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        flat = shifted.reshape(-1, part)
        rows = torch.arange(flat.shape[0], device=flat.device)
        predicted = flat[rows, local_target.reshape(-1)].reshape(target.shape).masked_fill(outside, 0.0)

        exp = shifted.exp_()  # `predicted` was gathered (copied) above
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target)
        part = grad.shape[-1]
        flat = grad.view(-1, part)
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token loss (same shape as target) from vocab-split logits [..., vocab/tp]."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
