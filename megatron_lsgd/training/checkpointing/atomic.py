"""Crash-safe writes: write under a temporary name, fsync, rename, fsync the parent.

A rename within one directory is atomic on POSIX file systems, so a reader sees either
the old or the new content, never a torn one. fsync of the file *and* of the directory
holding the new name makes that survive a power loss, not only a process kill.
"""

from __future__ import annotations

import os
import shutil

from megatron_lsgd.core.output_files import fsync_dir, fsync_file, write_text


def fsync_tree(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def write_text_atomic(path: str, text: str) -> None:
    write_text(path, text, durable=True)


def commit_dir(partial: str, final: str) -> None:
    """Move a fully written and fsynced directory to its final name. An existing `final`
    (re-saving an iteration after a resume) is moved aside first and removed afterwards,
    so there is no moment without one complete copy on disk."""
    old = None
    if os.path.exists(final):
        old = final + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
