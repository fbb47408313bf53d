"""The WAN tools turn bad flags into `error: ...` naming the flag and exit code 2 (no
traceback, no namespace created). Runs as a user would: `python -m tools.wan.<tool>`."""

import subprocess
import sys

import pytest

from tools.wan.netns import list_namespaces
from tools.wan.topology import REPO_ROOT

SCRIPT = ["--", "pretrain_gpt.py", "--num-layers", "2"]
TINY = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--train-iters", "3"]


def _run(module, args):
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stderr


def _namespaces():
    try:
        return set(list_namespaces())
    except Exception:  # no iproute2 here: nothing could have been created either
        return set()


@pytest.mark.parametrize("module,args,message", [
    ("tools.wan.launch", ["--sites", "0", *SCRIPT], "--sites 0 must be in 1..250"),
    ("tools.wan.launch", ["--rate-mbit", "0", *SCRIPT], "--rate-mbit 0.0 must be > 0"),
    ("tools.wan.launch", ["--delay-ms", "1", "--jitter-ms", "5", *SCRIPT], "--jitter-ms 5.0 must not exceed --delay-ms 1.0"),
    ("tools.wan.launch", ["--loss-pct", "100", *SCRIPT], "--loss-pct 100.0 must be in [0, 100)"),
    ("tools.wan.launch", ["--subnet", "192.168.1", *SCRIPT], "--subnet '192.168.1'"),
    ("tools.wan.launch", ["--ranks-per-site", "0", *SCRIPT], "--ranks-per-site must be >= 1"),
    # the training script's own flags, checked by the launcher before any site starts
    ("tools.wan.launch", SCRIPT, "required: --hidden-size"),
    ("tools.wan.launch", [*SCRIPT, *TINY, "--lsgd-algorithm", "diloco", "--lsgd-fault-tolerance", "torchft",
                          "--lsgd-warmup-iters", "5"], "--lsgd-warmup-iters does not work with --lsgd-fault"),
    ("tools.benchmarks.wan.wan_bench", ["--rate-mbit", "-5"], "--rate-mbit -5.0 must be > 0"),
    ("tools.benchmarks.wan.wan_bench", ["--slow-ranks", "x"], "--slow-ranks 'x'"),
    ("tools.wan.wire", ["--namespaces", "a,b", "--addresses", "1,2", "--rate-mbit", "0"], "--rate-mbit 0.0 must be > 0"),
    ("tools.wan.measure", ["bulk", "--port", "1", "--timeout", "2"], "error: bulk 127.0.0.1:1:"),
])
def test_bad_flags_are_messages(module, args, message):
    before = _namespaces()
    code, err = _run(module, args)
    assert code == 2 and message in err and "error:" in err
    assert _namespaces() == before
