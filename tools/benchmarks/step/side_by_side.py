"""One rank, one process: megatron_lsgd's training step beside a minimal plain-PyTorch loop
of the same GPTModel on the same batch (shared by overhead_bench.py and mfu.py).

The plain loop is what a user would write without the framework: the model's parameters
in fp32 (under torch.autocast when the run is bf16), torch.optim.AdamW, loss.backward(),
clip_grad_norm_. Timed steps synchronise the device before reading the clock.

With `--compile` in argv, both loops are compiled the same way (an honest peer): our Trainer
compiles each transformer layer's forward (core/transformer/compile.py) and the plain model's
layers get the very same treatment. `with_plain=False` builds no plain loop (memory probes).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import pretrain_gpt  # noqa: E402
from megatron_lsgd.core.models.gpt import GPTModel  # noqa: E402
from megatron_lsgd.core.transformer.compile import compile_layers  # noqa: E402
from megatron_lsgd.training.arguments import build_config, parse_args  # noqa: E402
from megatron_lsgd.training.initialize import init_distributed  # noqa: E402
from megatron_lsgd.training.training import Trainer  # noqa: E402


@dataclasses.dataclass
class SideBySide:
    ours: Callable[[], None]  # one training step of megatron_lsgd
    plain: Optional[Callable[[], None]]  # one step of the plain loop (None: not built)
    trainer: Trainer
    plain_model: Optional[torch.nn.Module]
    device: torch.device
    tokens_per_step: int


def build(argv: List[str], lr: float = 1e-4, clip_grad: float = 1.0, with_plain: bool = True) -> SideBySide:
    """`argv`: pretrain_gpt flags of a world of one (with --mock-data)."""
    args = parse_args(argv)
    device = init_distributed(None, 10)
    config = build_config(args, 1)
    trainer = Trainer(config, pretrain_gpt.model_provider, pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.forward_step, device)
    batch = {k: v.to(device) for k, v in next(trainer.train_iterator).items()}

    def ours_step():  # the loop's step: the synchronizer composes the inner step's parts
        trainer.inner_step.iteration = trainer.position.iteration
        trainer.synchronizer.train_step(trainer.inner_step, iter([batch]), trainer.position.iteration)
        trainer.position.iteration += 1

    tokens = config.training.micro_batch_size * config.model.seq_length
    if not with_plain:
        return SideBySide(ours_step, None, trainer, None, device, tokens)
    bf16 = config.model.params_dtype == torch.bfloat16
    plain = GPTModel(dataclasses.replace(config.model, params_dtype=torch.float32), trainer.pgs,
                     trainer.rng_tracker).to(device)
    plain.initialize(config.training.seed)
    if config.training.compile:  # the same regional compilation as ours (ours reset dynamo's caches)
        compile_layers(plain.layers, fresh=False)
    # what a careful plain loop uses: the fused kernel on a GPU
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.01, **kernel)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            losses = plain(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), clip_grad)
        opt.step()

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
