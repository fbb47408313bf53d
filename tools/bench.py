"""One entry to the benchmarks: `python -m tools.bench SUBCOMMAND [ARGS]`, from the checkout.

It runs the tool's own script as `__main__` with ARGS, so `python -m tools.bench board
--cached-only` is `python tools/benchmarks/leaderboard.py --cached-only` (those paths keep
working), and `python -m tools.bench SUBCOMMAND --help` is the tool's own help. Every
algorithm's settings in them come from tools/benchmarks/recipes.py.
"""

from __future__ import annotations

import runpy
import sys
from typing import Dict, List, Tuple

# subcommand -> (the tool's module, what it answers); `step` picks one of two tools by its next word
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "quality": ("tools.benchmarks.lsgd_quality", "quality at equal tokens, per algorithm and variant"),
    "frontier": ("tools.benchmarks.quality_frontier", "cross-site bytes saved against validation loss; the "
                                                      "model-size ladder (--ladder S|M|L)"),
    "board": ("tools.benchmarks.leaderboard", "the leaderboard: time to a validation loss per WAN scenario, "
                                              "simulated clock"),
    "wan": ("tools.benchmarks.wan_bench", "every algorithm over an emulated WAN, beside the ceiling (root)"),
    "validate": ("tools.benchmarks.validate_clock", "the simulated clock against the emulated WAN"),
    "step mfu": ("tools.benchmarks.mfu", "one device's step: throughput and MFU beside plain PyTorch (--preset)"),
    "step overhead": ("tools.benchmarks.overhead_bench", "one rank's step: framework overhead against a plain "
                                                         "PyTorch loop"),
    "chaos": ("tools.benchmarks.chaos", "elastic sites killed and restarted: what survives"),
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
