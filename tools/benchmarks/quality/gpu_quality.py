"""The GPU quality study in one command: sync, diloco, dilocox and streaming-diloco on a
50-125M-parameter Llama-style model trained on docs-corpus, two sites sharing one GPU (gloo
between them), bf16, with a token budget sized from the throughput measured first, so that the
whole study fits --minutes. It writes its table into docs/quality.md (block `gpu-study`) with
the date and the device, its raw results into results/quality-gpu-study.json.

    python -m tools.bench quality gpu  # on a machine with a GPU, ~8 minutes

Steps: (1) the corpus (tools/prepare_corpus.py) unless data/docs-corpus has it; (2) a pilot:
sync for --pilot-iters steps, its tokens/s; (3) each of the four runs gets an equal share of
what is left of --minutes, less a start-up allowance per run, as whole steps; (4) the runs, through
tools/benchmarks/quality/quality_frontier.py (its cache under runs/gpu_quality: a stopped study resumes).
The model reads a fraction of one pass over the corpus (far below 20 tokens per parameter): the
table says how many tokens per parameter it is, and it is a GPU check of the ladder's ranking,
not a replacement for it.

`--tiny` shrinks the model and budget (and allows the CPU) to test the pipeline; its table goes
under runs/, never into docs/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from tools.benchmarks.quality import quality_frontier  # noqa: E402
from tools.benchmarks.quality.lsgd_quality import base_argv, data_argv, run  # noqa: E402
from tools.benchmarks.run_cache import positive_int  # noqa: E402
from tools.benchmarks.spawned_ranks import run_tool  # noqa: E402

CORPUS = os.path.join(ROOT, "data", "docs-corpus")
TRAIN = os.path.join(CORPUS, "docs_corpus_train_text_document")
VALID = os.path.join(CORPUS, "docs_corpus_valid_text_document")
TOKENIZER = os.path.join(CORPUS, "docs_corpus_sp4k.model")

# (layers, hidden, heads, sequence, global batch): 62M parameters at 4,096 pieces (12 x 640: 59.5M
# in the layers, 2.7M in the tied embedding); --tiny: a pipeline check only
SHAPES = {"study": (12, 640, 10, 1024, 32), "tiny": (2, 64, 4, 64, 8)}
POINTS = [  # the study's runs beside sync (their families' defaults, H = 30 where they take one)
    "diloco-H30=diloco:--lsgd-algorithm diloco --lsgd-interval 30",
    "dilocox-H30=dilocox:--lsgd-algorithm dilocox --lsgd-interval 30",
    "streaming-diloco-H30=streaming-diloco:--lsgd-algorithm streaming-diloco --lsgd-interval 30",
]
RUNS = 1 + len(POINTS)


def study_iters(minutes: float, tokens_per_second: float, tokens_per_step: int, spent_seconds: float,
                startup_seconds: float, floor: int) -> int:
    """Whole steps per run so that RUNS runs, each with its start-up, fit what is left of `minutes`."""
    left = minutes * 60 - spent_seconds - RUNS * startup_seconds
    steps = int(left / RUNS * tokens_per_second / tokens_per_step)
    if steps < floor:
        raise ValueError(f"--minutes {minutes:g}: the pilot measured {tokens_per_second:,.0f} tokens/s, which leaves "
                         f"{max(steps, 0)} steps a run (at least {floor} needed); give more minutes")
    return steps


def _vocab(tokenizer_model: str) -> int:
    """Token ids of a SentencePiece model as the runs use it: its pieces and Megatron's specials."""
    from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer  # noqa: PLC0415

    return build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=tokenizer_model)).vocab_size


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "CPU"


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=8.0, help="the whole study's time, pilot and start-ups included")
    p.add_argument("--pilot-iters", type=positive_int, default=20)
    p.add_argument("--startup-seconds", type=float, default=25.0, help="allowance per run for start-up and evaluation")
    p.add_argument("--tiny", action="store_true", help="a tiny model on any device: tests the pipeline, measures nothing")
    p.add_argument("--data-path", default=None, help="training .bin/.idx prefix (default: docs-corpus's, prepared if missing)")
    p.add_argument("--valid-data-path", default=None, help="held-out prefix (default: docs-corpus's)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--doc", default=None, help="page to write (default docs/quality.md; --tiny: runs/gpu_quality_tiny)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        p.error("no GPU here (torch.cuda.is_available() is False): the study needs one; --tiny checks the pipeline")
    if args.minutes <= 0:
        p.error(f"--minutes must be > 0 (got {args.minutes:g})")
    started = time.perf_counter()
    train, valid, tokenizer = args.data_path or TRAIN, args.valid_data_path or VALID, args.tokenizer_model or TOKENIZER
    if args.data_path is None and not os.path.exists(TRAIN + ".bin"):
        sys.path.insert(0, os.path.join(ROOT, "tools"))  # the tools import their neighbours by name
        import prepare_corpus  # noqa: PLC0415

        prepare_corpus.main(["--input", os.path.join(ROOT, "..", "shared", "data", "docs-corpus.jsonl.gz"),
                             "--output-dir", CORPUS, "--name", "docs_corpus", "--vocab-size", "4096",
                             "--workers", str(max(1, min(16, os.cpu_count() or 1)))])
    layers, hidden, heads, seq, batch = SHAPES["tiny" if args.tiny else "study"]
    precision = ["--bf16"] if device == "cuda" else []
    extra = ["--device", device, "--distributed-backend", "gloo", "--num-attention-heads", str(heads)] + precision
    try:
        data, _ = data_argv(train, tokenizer, valid)
    except ValueError as err:
        p.error(str(err))
    pilot = base_argv(num_layers=layers, hidden_size=hidden, seq_length=seq, global_batch_size=batch,
                      train_iters=args.pilot_iters, lr=1e-3, eval_interval=0, eval_iters=1, sites=2, data=data,
                      extra=extra) + ["--lsgd-algorithm", "sync"]
    print(f"> pilot: sync, {args.pilot_iters} steps of {batch} x {seq} tokens on {device_name(device)}", flush=True)
    measured = run(pilot, 2)["tokens_per_s"]
    try:
        iters = study_iters(args.minutes, measured, batch * seq, time.perf_counter() - started, args.startup_seconds,
                            floor=2 * 30 if not args.tiny else 4)
    except ValueError as err:
        p.error(str(err))
    print(f"> {measured:,.0f} tokens/s: {iters} steps a run ({iters * batch * seq:,} tokens)", flush=True)
    doc = args.doc or (os.path.join(ROOT, "runs", "gpu_quality_tiny", "quality.md") if args.tiny
                       else os.path.join(ROOT, "docs", "quality.md"))
    params = quality_frontier.ladder_parameters(quality_frontier.Rung("gpu", layers, hidden, 0),
                                                vocab=_vocab(tokenizer))["total"]
    note = (f"GPU study, {datetime.date.today().isoformat()}, {device_name(device)}"
            f"{' (TINY: a pipeline check, measures nothing)' if args.tiny else ''}; 2 sites sharing the device, gloo "
            f"between them, {'bf16' if precision else 'fp32'}; {layers} layers x {hidden} ({params / 1e6:.1f}M parameters, "
            f"{iters * batch * seq / params:.2f} tokens per parameter); budget sized from the pilot's "
            f"{measured:,.0f} tokens/s.")
    flags = ["--doc", doc, "--block", "gpu-study", "--header-note", note, "--seeds", "1",
             "--cache-dir", os.path.join(ROOT, "runs", "gpu_quality_tiny" if args.tiny else "gpu_quality"),
             "--data-path", train, "--valid-data-path", valid, "--tokenizer-model", tokenizer,
             "--num-layers", str(layers), "--hidden-size", str(hidden), "--seq-length", str(seq),
             "--global-batch-size", str(batch), "--train-iters", str(iters), "--lr", "1e-3", "--eval-iters", "8",
             "--extra-args", " ".join(extra), "--points", ",".join(pt.split("=")[0] for pt in POINTS)]
    for pt in POINTS:
        flags += ["--point", pt]
    quality_frontier.main(flags)
    print(f"gpu_quality: {time.perf_counter() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    run_tool(main, "finished runs are kept under runs/gpu_quality; the same command resumes after them")
