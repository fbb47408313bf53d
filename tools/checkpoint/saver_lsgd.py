"""convert.py saver: a megatron_lsgd checkpoint for a target TP x PP (with the optimizer state
when the loader read it, else model weights only)."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel, write_lsgd


def add_arguments(parser) -> None:
    g = parser.add_argument_group("lsgd saver")
    g.add_argument("--target-tensor-parallel-size", type=int, default=1)
    g.add_argument("--target-pipeline-parallel-size", type=int, default=1)


def save_checkpoint(model: FullModel, args) -> str:
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1")
    try:
        model.config.validate(tp, pp)
    except ValueError as err:  # the model's own flags do not exist here: name this tool's
        raise ValueError(f"cannot split the model for --target-tensor-parallel-size {tp} x "
                         f"--target-pipeline-parallel-size {pp}: {err}") from None
    return write_lsgd(model, args.save_dir, tp, pp)
