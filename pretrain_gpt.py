"""Pre-train a GPT / Llama model with tensor, pipeline and (cross-site) data parallelism.

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --train-iters 20 \\
        --lr 1e-3 --mock-data --vocab-size 512 --num-sites 2

Run with --help for every flag.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_lsgd.core.datasets import build_train_valid_test_datasets
from megatron_lsgd.core.models.gpt import GPTModel
from megatron_lsgd.training.initialize import exit_finished_run, shutdown_distributed
from megatron_lsgd.training.training import pretrain


def model_provider(config, pgs, rng_tracker, pre_process: bool = True, post_process: bool = True) -> GPTModel:
    return GPTModel(config.model, pgs, rng_tracker, pre_process=pre_process, post_process=post_process)


def train_valid_test_datasets_provider(config, tokenizer, num_samples):
    return build_train_valid_test_datasets(config.data, tokenizer, num_samples)


def get_batch(data_iterator, device: torch.device) -> dict:
    batch = next(data_iterator)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """Mean token loss of the micro-batch over unmasked tokens. With per_token
    (--calculate-per-token-loss), Megatron's contract: the summed loss, the number of loss
    tokens and the report (sum, tokens), normalized over the whole step by the schedule."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    if per_token:
        total, tokens = torch.sum(losses * mask), mask.sum()
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.detach()])}
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, device)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    per_token = getattr(model, "module", model).config.calculate_per_token_loss  # (model may be DDP-wrapped)
    return output, partial(loss_func, batch["loss_mask"], per_token=per_token)


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)


if __name__ == "__main__":
    main()
    shutdown_distributed()
    exit_finished_run()  # gloo's teardown can abort a finished run (initialize.exit_finished_run)
