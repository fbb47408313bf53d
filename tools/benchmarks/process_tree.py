"""Killing a launcher and everything it started, for the tools and tests that SIGKILL runs
(chaos.py's sites, the checkpoint tests' crashes). torchrun starts each rank in a session of
its own, so killing the launcher's process group would not reach the ranks: the tree is read
from /proc instead."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, List


def descendants(pid: int) -> List[int]:
    """Every live process below `pid`."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def sigkill(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    """True while any thread of `pid` has not exited. A killed process's main thread turns
    zombie before its other threads (gloo's, say) are gone, and the open files, a save lock
    among them, are released only with the last thread."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            continue  # that thread is gone
    return False


def kill_tree(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGKILL the launcher and every process below it at once (no clean exit, no finally
    blocks), then wait until all are gone, so a run started next does not find the killed one
    still holding its files. False if some were still alive after `timeout_s`."""
    victims = [proc.pid] + descendants(proc.pid)
    sigkill(victims)
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in victims):
        if time.monotonic() > deadline:
            return False
        sigkill(victims)
        time.sleep(0.05)
    return True
