"""What one blocking inter-site exchange costs over a shaped link: a gloo all-reduce between
two sites, timed, and the machine's CPU it kept busy.

    ip netns exec A python -m tools.wan.collective_probe --rank 0 --master 10.77.0.1 --bytes 28800000 &
    ip netns exec B python -m tools.wan.collective_probe --rank 1 --master 10.77.0.1 --bytes 28800000

Each repetition idles `--gap` seconds first (as a training step's compute does, so TCP's
window starts from where training leaves it), then all-reduces `--bytes` of fp32. Rank 0
prints one JSON line: every repetition's seconds and the machine's busy CPU seconds during
it (/proc/stat: every process and the kernel, the link's own process included), less what
the gap showed as background.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import List, Tuple

import torch
import torch.distributed as dist


def busy_cpu_seconds() -> float:
    """The machine's CPU seconds not idle since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def probe(nbytes: int, repeats: int, gap: float) -> List[Tuple[float, float]]:
    """(seconds, busy CPU seconds beyond the background) of each all-reduce."""
    tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    dist.all_reduce(tensor)  # connections up before anything is timed
    out = []
    for _ in range(repeats):
        dist.barrier()
        c0, t0 = busy_cpu_seconds(), time.perf_counter()
        time.sleep(gap)
        background = (busy_cpu_seconds() - c0) / max(time.perf_counter() - t0, 1e-9)  # CPU s per s while idle
        c1, t1 = busy_cpu_seconds(), time.perf_counter()
        dist.all_reduce(tensor)
        seconds = time.perf_counter() - t1
        out.append((seconds, max(busy_cpu_seconds() - c1 - background * seconds, 0.0)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True, choices=(0, 1))
    p.add_argument("--master", required=True, help="rank 0's address")
    p.add_argument("--port", type=int, default=29811)
    p.add_argument("--bytes", type=int, required=True, help="fp32 bytes all-reduced per repetition")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.5, help="idle seconds before each all-reduce")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=2,
                            timeout=timedelta(seconds=a.timeout))
    try:
        runs = probe(a.bytes, a.repeats, a.gap)
    finally:
        dist.destroy_process_group()
    if a.rank == 0:
        print(json.dumps({"bytes": a.bytes, "seconds": [s for s, _ in runs], "busy_cpu_s": [c for _, c in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
