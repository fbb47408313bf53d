"""Run `ip` / `tc` commands; failures raise WanError carrying the command and its stderr."""

from __future__ import annotations

import subprocess
from typing import List, Sequence


class WanError(RuntimeError):
    """Emulation cannot be set up; the message says what is missing or what failed."""


def run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise WanError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def in_ns(ns: str, cmd: Sequence[str]) -> List[str]:
    """Prefix a command so it runs inside network namespace `ns`."""
    return ["ip", "netns", "exec", ns, *cmd]


def list_namespaces() -> List[str]:
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespace(ns: str) -> None:
    """Deleting a namespace also destroys the interfaces (veth ends, TUNs) inside it."""
    run(["ip", "netns", "delete", ns], check=False)
