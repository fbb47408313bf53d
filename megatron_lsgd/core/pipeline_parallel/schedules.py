"""Forward/backward schedules over micro-batches: no pipelining, and 1F1B.

A schedule knows nothing about synchronizers. It calls `forward_step_func(data_iterator,
model)` -> (output, loss_func) and marks the last micro-batch's backward so the DDP layer
fires its per-bucket reductions and per-layer "backward done" notifications; per-layer
forward hooks are plain module pre-hooks on the model's sync units, and `on_forward(i)`
tells whoever asked which micro-batch is about to run forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
from megatron_lsgd.core.parallel_state import ProcessGroups
from megatron_lsgd.core.pipeline_parallel.p2p import PipelineP2P


@dataclass
class ScheduleSpec:
    num_microbatches: int
    tensor_shape: tuple  # activation shape between stages: [s(/tp), micro_batch, hidden]
    dtype: torch.dtype
    device: torch.device
    forward_only: bool = False
    loss_scale: float = 1.0  # fp16: scale the loss before backward
    free_sent_outputs: bool = True  # 1F1B: drop a stage output's values once sent (see _free_sent_output)
    # --calculate-per-token-loss: the loss function returns (loss sum, tokens, report); the
    # schedule backpropagates the sums and adds up the tokens here (the caller normalizes).
    per_token_loss: bool = False
    num_tokens: Optional[torch.Tensor] = None
    on_forward: Optional[Callable[[int], None]] = None  # called with a micro-batch's index before its forward
    # Each micro-batch's loss is divided by this before backward (None: num_microbatches, the
    # mean over the call). A caller that accumulates one step over several schedule calls
    # (ACCO/DPU's adaptive accumulation) passes a common divisor.
    loss_divisor: Optional[int] = None


def _microbatch_context(model, is_last: bool):
    if isinstance(model, DistributedDataParallel) and not is_last:
        return model.no_sync()
    return contextlib.nullcontext()


def _forward(forward_step_func, data_iterator, model, input_tensor, spec: ScheduleSpec, pgs: ProcessGroups,
             losses: List[Dict[str, torch.Tensor]], index: int):
    if spec.on_forward is not None:
        spec.on_forward(index)
    model.set_input_tensor(input_tensor)
    output, loss_func = forward_step_func(data_iterator, model)
    if pgs.is_last_stage:
        divisor = spec.num_microbatches if spec.loss_divisor is None else spec.loss_divisor
        result = loss_func(output)
        if len(result) == 3:  # Megatron's contract: (loss summed over tokens, number of tokens, report)
            loss, num_tokens, reported = result
            if spec.per_token_loss:
                spec.num_tokens = num_tokens if spec.num_tokens is None else spec.num_tokens + num_tokens
                output = loss
            else:
                output = loss / num_tokens.clamp(min=1) / divisor
        else:
            loss, reported = result
            if spec.per_token_loss:
                raise ValueError("--calculate-per-token-loss needs a loss function returning (loss sum, number "
                                 "of tokens, report), as Megatron's does")
            output = loss / divisor
        losses.append(reported)
    return output


def _free_sent_output(output: torch.Tensor, spec: ScheduleSpec) -> None:
    """1F1B keeps a stage's output until its backward, but once the output has been sent to
    the next stage only its autograd graph is still needed (backward starts from the
    gradient the next stage sends back), not its values. Like Megatron, replace the values
    with a one-element placeholder right after the send, so up to PP - stage in-flight
    outputs stop holding [s, b, h] each. Views are left alone (their storage is shared)."""
    if spec.free_sent_outputs and not spec.forward_only and output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _backward(input_tensor, output, output_grad, spec: ScheduleSpec):
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:  # last stage: output is the scalar loss
        output = output * spec.loss_scale
    if output_grad is not None and output.shape != output_grad.shape:
        # A freed output (_free_sent_output): torch.autograd.backward would compare the
        # placeholder's shape with the gradient's, so call the engine directly. The graph
        # node recorded the real shape and checks the gradient against it.
        torch.autograd.Variable._execution_engine.run_backward(
            (output,), (output_grad,), False, False, (), True, True)
    else:
        torch.autograd.backward(output, grad_tensors=output_grad)
    return None if input_tensor is None else input_tensor.grad


def forward_backward_no_pipelining(forward_step_func: Callable, data_iterator, model, spec: ScheduleSpec,
                                   pgs: ProcessGroups) -> List[Dict[str, torch.Tensor]]:
    losses: List[Dict[str, torch.Tensor]] = []
    for i in range(spec.num_microbatches):
        is_last = i == spec.num_microbatches - 1
        with _microbatch_context(model, is_last):
            ctx = torch.no_grad() if spec.forward_only else contextlib.nullcontext()
            with ctx:
                output = _forward(forward_step_func, data_iterator, model, None, spec, pgs, losses, i)
            if not spec.forward_only:
                _backward(None, output, None, spec)
    return losses


def forward_backward_pipelining_1f1b(forward_step_func: Callable, data_iterator, model, spec: ScheduleSpec,
                                     pgs: ProcessGroups) -> List[Dict[str, torch.Tensor]]:
    """One forward, one backward in steady state: at most (PP - stage) micro-batches'
    activations alive per stage."""
    p2p = PipelineP2P(pgs, spec.tensor_shape, spec.dtype, spec.device)
    n = spec.num_microbatches
    warmup = min(pgs.dims.pp - pgs.pp_rank - 1, n)
    steady = n - warmup
    losses: List[Dict[str, torch.Tensor]] = []
    inputs: List[Optional[torch.Tensor]] = []
    outputs: List[torch.Tensor] = []
    backward_done = 0
    forward_done = 0

    def run_backward(input_tensor, output, output_grad):
        nonlocal backward_done
        is_last = backward_done == n - 1
        with _microbatch_context(model, is_last):
            grad = _backward(input_tensor, output, output_grad, spec)
        backward_done += 1
        return grad

    grad_ctx = torch.no_grad() if spec.forward_only else contextlib.nullcontext()

    def run_forward(input_tensor):
        nonlocal forward_done
        with grad_ctx:
            output = _forward(forward_step_func, data_iterator, model, input_tensor, spec, pgs, losses, forward_done)
        forward_done += 1
        return output

    for _ in range(warmup):
        input_tensor = p2p.recv_forward()
        output = run_forward(input_tensor)
        p2p.send_forward(output)
        if not spec.forward_only:
            if not pgs.is_last_stage:
                _free_sent_output(output, spec)
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = p2p.recv_forward() if steady > 0 else None
    for i in range(steady):
        last_steady = i == steady - 1
        output = run_forward(input_tensor)
        if spec.forward_only:
            p2p.send_forward(output)
            if not last_steady:
                input_tensor = p2p.recv_forward()
            continue
        output_grad = p2p.send_forward_recv_backward(output)
        if not pgs.is_last_stage:
            _free_sent_output(output, spec)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = run_backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last_steady:
            input_tensor = None
            p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad)

    if not spec.forward_only:
        for _ in range(warmup):
            output_grad = p2p.recv_backward()
            input_grad = run_backward(inputs.pop(0), outputs.pop(0), output_grad)
            p2p.send_backward(input_grad)
    return losses


def get_forward_backward_func(pp_size: int):
    return forward_backward_pipelining_1f1b if pp_size > 1 else forward_backward_no_pipelining
