"""One rank, one process: megatron_lsgd's training step beside a minimal plain-PyTorch loop
of the same GPTModel on the same batch (shared by overhead_bench.py and mfu.py).

The plain loop is what a user would write without the framework: the model's parameters
in fp32 (under torch.autocast when the run is bf16), torch.optim.AdamW, loss.backward(),
clip_grad_norm_. Timed steps synchronise the device before reading the clock.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt  # noqa: E402
from megatron_lsgd.core.models.gpt import GPTModel  # noqa: E402
from megatron_lsgd.training.arguments import build_config, parse_args  # noqa: E402
from megatron_lsgd.training.initialize import init_distributed  # noqa: E402
from megatron_lsgd.training.training import Trainer  # noqa: E402


@dataclasses.dataclass
class SideBySide:
    ours: Callable[[], None]  # one training step of megatron_lsgd
    plain: Callable[[], None]  # one step of the plain loop
    trainer: Trainer
    plain_model: torch.nn.Module
    device: torch.device
    tokens_per_step: int


def build(argv: List[str], lr: float = 1e-4, clip_grad: float = 1.0) -> SideBySide:
    """`argv`: pretrain_gpt flags of a world of one (with --mock-data)."""
    args = parse_args(argv)
    device = init_distributed(None, 10)
    config = build_config(args, 1)
    trainer = Trainer(config, pretrain_gpt.model_provider, pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.forward_step, device)
    bf16 = config.model.params_dtype == torch.bfloat16
    plain = GPTModel(dataclasses.replace(config.model, params_dtype=torch.float32), trainer.pgs,
                     trainer.rng_tracker).to(device)
    plain.initialize(config.training.seed)
    # what a careful plain loop uses: the fused kernel on a GPU
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.01, **kernel)
    batch = {k: v.to(device) for k, v in next(trainer.train_iterator).items()}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            losses = plain(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), clip_grad)
        opt.step()

    def ours_step():  # the loop's step: the synchronizer composes the inner step's parts
        trainer.inner_step.iteration = trainer.iteration
        trainer.synchronizer.train_step(trainer.inner_step, iter([batch]), trainer.iteration)
        trainer.iteration += 1

    tokens = config.training.micro_batch_size * config.model.seq_length
    return SideBySide(ours_step, plain_step, trainer, plain, device, tokens)


def timed(step: Callable[[], None], n: int, device: torch.device, clock: Callable[[], float] = time.perf_counter
          ) -> float:
    """Seconds for n steps, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - t0
