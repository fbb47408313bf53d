"""One entry to the benchmarks: `python -m tools.bench SUBCOMMAND [ARGS]`, from the checkout.

It runs the tool's own script as `__main__` with ARGS, so `python -m tools.bench board
--cached-only` is `python tools/benchmarks/board/leaderboard.py --cached-only` (those paths
keep working), and `python -m tools.bench SUBCOMMAND --help` is the tool's own help. The tools
live in tools/benchmarks/, one package per family (its __init__.py says what the family
answers); every algorithm's settings in them come from tools/benchmarks/recipes.py.
"""

from __future__ import annotations

import runpy
import sys
from typing import Dict, List, Tuple

# subcommand -> (the tool's module, what it answers); a two-word one (`step mfu`) is matched before one word,
# and the first word of a family of several tools (`step`, `parts`) is not a subcommand by itself
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "quality": ("tools.benchmarks.quality.lsgd_quality", "quality at equal tokens, per algorithm and variant"),
    "quality gpu": ("tools.benchmarks.quality.gpu_quality", "the quality study on one GPU, sized to --minutes"),
    "frontier": ("tools.benchmarks.quality.quality_frontier", "cross-site bytes saved against validation loss; "
                                                              "the model-size ladder (--ladder S|M|L)"),
    "board": ("tools.benchmarks.board.leaderboard", "the leaderboard: time to a validation loss per WAN scenario, "
                                                    "simulated clock"),
    "wan": ("tools.benchmarks.wan.wan_bench", "every algorithm over an emulated WAN, beside the ceiling (root)"),
    "wan report": ("tools.benchmarks.wan.wan_report", "a wan run's table and plots again, from its logs"),
    "validate": ("tools.benchmarks.wan.validate_clock", "the simulated clock against the emulated WAN"),
    "step mfu": ("tools.benchmarks.step.mfu", "one device's step: throughput and MFU beside plain PyTorch "
                                              "(--preset)"),
    "step overhead": ("tools.benchmarks.step.overhead_bench", "one rank's step: framework overhead against a "
                                                              "plain PyTorch loop"),
    "step clock": ("tools.benchmarks.step.clock_cost", "one rank's step: what the device-synchronised clock costs"),
    "chaos": ("tools.benchmarks.elastic.chaos", "elastic sites killed and restarted: what survives"),
    "parts data": ("tools.benchmarks.parts.data_bench", "the data pipeline: preprocessing and index building"),
    "parts convert": ("tools.benchmarks.parts.convert_memory", "checkpoint conversion: peak host memory against "
                                                               "model size"),
    "parts dreamddp": ("tools.benchmarks.parts.dreamddp_scheduler_bench", "DreamDDP's scheduler against brute "
                                                                          "force on random profiles"),
    "plan": ("tools.plan", "which algorithm, with which settings, trains a job fastest over its link"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    return "\n".join(["usage: python -m tools.bench SUBCOMMAND [ARGS] (SUBCOMMAND --help: the tool's own)", ""]
                     + [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()])


def resolve(argv: List[str]) -> Tuple[str, List[str]]:
    """(module, the rest of argv) for a command line; ValueError for an unknown subcommand."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in SUBCOMMANDS:
            return SUBCOMMANDS[name][0], argv[words:]
    raise ValueError(f"unknown subcommand {' '.join(argv[:2])!r}" if argv else "no subcommand")


def main(argv: List[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    try:
        module, rest = resolve(argv)
    except ValueError as err:
        sys.exit(f"error: {err}\n\n{usage()}")
    sys.argv = [sys.argv[0]] + rest  # (run_module replaces argv[0] with the tool's file)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
