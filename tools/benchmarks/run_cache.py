"""Finished benchmark runs kept as JSON, so a sweep of hours resumes where it stopped
(leaderboard.py's cells, quality_frontier.py's points). A run is named by a digest of its
flags; paths inside a checkout are named relative to it, so a cache holds from any clone or worktree."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
from typing import Callable, Dict, List, Optional

from megatron_lsgd.core.output_files import write_json
from tools.benchmarks.tool_input import read_json_object

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")  # pages (.md) and the figures they show
RESULTS = os.path.join(ROOT, "results")  # measured data: cells, runs, raw JSON, logs (results/README.md)


def results_path(path: str) -> str:
    """Where the measured data of something written at `path` is kept: results/P for docs/P (the
    same layout, outside docs/, which holds only pages and their figures); a path outside docs/
    (runs/, a temporary directory) keeps its data beside it, as it is."""
    full = os.path.abspath(path)
    rel = os.path.relpath(full, DOCS)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return path
    return os.path.normpath(os.path.join(RESULTS, rel))


def relative_flags(argv: List[str]) -> List[str]:
    """`argv` with every absolute path inside a checkout of this project named relative to
    that checkout: this one's, or another's (a second worktree running a board with
    --data-path into the first), so the same file gives the same digest from either."""
    return [_relative_to_checkout(a) for a in argv]


def _relative_to_checkout(arg: str) -> str:
    if not os.path.isabs(arg):
        return arg
    here = os.path.dirname(arg)
    while here != os.path.dirname(here):
        if os.path.isfile(os.path.join(here, "tools", "benchmarks", "run_cache.py")):  # a checkout of this project
            return os.path.relpath(arg, here)
        here = os.path.dirname(here)
    return arg


def load_or_run(path: str, compute: Callable[[], Optional[Dict]], refresh: bool = False,
                resolved: Optional[Dict[str, object]] = None) -> Optional[Dict]:
    """The result cached at `path`, else `compute()`'s, written atomically (a run stopped while
    writing leaves no half file). None from `compute` (a failed or skipped run) is not cached.
    `refresh`: compute even if cached, replacing the old result only when the new one exists.
    `resolved` (resolved_arguments: every argument the flags resolve to, defaults included) is
    stored with the result; a cached result one of whose arguments resolved to another value
    was made under other defaults and is computed again. Arguments on one side only (a flag
    added or removed since) say nothing about the run and are not compared: a new flag does
    not throw the cache away. (A result stored with only a digest of them, as before, must
    match all of them, or all but ADDED_AFTER_DIGESTS; one stored with neither is taken as is.) The code it was computed
    with is stored too (`code`, see code_version): a change to an algorithm's code changes no
    flag, and this is how a later reader tells which results predate it."""
    if os.path.exists(path) and not refresh:
        cached = read_json_object(path, "cached result", "delete it to compute the run again")
        changed = changed_arguments(cached, resolved)
        if not changed:
            return cached
        print(f"  {os.path.basename(path)} was made under other defaults ({', '.join(changed[:3])} resolve "
              f"differently now)", flush=True)
    result = compute()
    if result is None:
        return None
    if resolved is not None:
        result = {**result, "resolved": resolved}
    code = code_version()
    if code is not None:
        result = {**result, "code": code}
    # the last bits of a CPU run depend on the machine: results from two differ in them
    result = {**result, "platform": platform_signature()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_json(path, result)
    return result


def changed_arguments(cached: Dict, resolved: Optional[Dict[str, object]]) -> List[str]:
    """The arguments a cached result resolved differently from `resolved`, except those only
    other algorithms read (for a result that kept only their digest: ["the digest of the
    arguments"] unless it matches all of them)."""
    if resolved is None:
        return []
    if "resolved" in cached:
        from megatron_lsgd.core.lsgd.catalog import arguments_it_ignores

        before = cached["resolved"]
        # another algorithm's own options (a default of edit's that changed says nothing of a sync run)
        unread = set(arguments_it_ignores(resolved["lsgd_algorithm"])) if "lsgd_algorithm" in resolved else set()
        return sorted(k for k in (before.keys() & resolved.keys()) - unread if before[k] != resolved[k])
    if "fingerprint" in cached:
        before = {k: v for k, v in resolved.items() if k not in ADDED_AFTER_DIGESTS}
        if cached["fingerprint"] not in (arguments_digest(resolved), arguments_digest(before)):
            return ["the digest of the arguments"]
    return []


# Arguments added while results kept only a digest of theirs (until 2026-11-27): a digest-only
# result made before one existed matches without it, one made after with it.
ADDED_AFTER_DIGESTS = ("lsgd_dpu_warmup_iters",)


def resolved_arguments(argv: List[str]) -> Dict[str, object]:
    """Every training argument the flags resolve to, defaults included, as JSON values: a cached
    run whose flags lean on a default that changed since is not taken for a run of today's.
    Paths inside the checkout count relative to it, as in the run's name."""
    from megatron_lsgd.training.arguments import parse_args

    resolved = sorted(vars(parse_args(relative_flags(argv))).items())
    return {k: json.loads(json.dumps(v, default=str)) for k, v in resolved}


SEEDS_HELP = "N: seeds 1..N; a-b: seeds a..b; a,b,c: those seeds"


def seed_list(text: str) -> List[int]:
    """The seeds a sweep's --seeds names (an argparse type, the same in every benchmark):
    "3" is seeds 1, 2, 3 (a count, as it always was for the leaderboard), "2-3" a range, "1,3"
    a list; a single seed other than 1 is "2-2"."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",")]
        elif "-" in text.strip("-"):
            first, last = (int(s) for s in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = list(range(1, int(text) + 1))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 1 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give N (seeds 1..N), a-b or a,b,c of distinct seeds >= 1")
    return seeds


def positive_int(text: str) -> int:
    """An argparse type for a count a sweep cannot run with at 0 (steps, sites, sizes)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def arguments_digest(resolved: Dict[str, object]) -> str:
    """The short digest results kept before they kept the arguments themselves."""
    return hashlib.sha256(json.dumps(sorted(resolved.items())).encode()).hexdigest()[:16]


LIBRARY = ("megatron_lsgd", "pretrain_gpt.py")  # what a run's numbers depend on, beside its flags


def platform_signature() -> str:
    """What decides the last bits of a CPU run: the CPU's vendor and model, the vector
    instructions torch dispatches to, and the torch build."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__}"


def code_version() -> Optional[str]:
    """The commit of this checkout, with "+changes" when the library differs from it; None
    outside a git checkout. `git diff <commit> -- megatron_lsgd/core/lsgd/algorithms/acco.py` then says
    whether a cached result predates a change of acco."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--", *LIBRARY)
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changed else "")
