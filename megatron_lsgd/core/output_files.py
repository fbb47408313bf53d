"""A failed write of an output file (a full disk, a quota, a file size limit, any I/O error)
becomes one `WriteError` that names the file, and what was half-written is removed.

Used by every writer of the project (checkpoints, --json-log, tensorboard, Hugging Face
exports, preprocessed datasets, the tools' caches, pages, reports and plots), so a full disk
reads the same everywhere; tests/unit_tests/core/test_writers.py finds every write call in the
code and fails on one that does not go through here. A whole file (a cache cell, a page, a
plot) is written by `replaced_atomically` / `write_text` / `write_json`: under a temporary
name, renamed over the old one only when complete, so a failure leaves the earlier output. Some writers hide the
OSError: torch's zip writer turns a failed write into `RuntimeError: unexpected pos ...`
with the OSError only as its context, so `os_error_in` looks through the chain; the
safetensors writer (Rust) raises a `SafetensorError` that names the OS error in its text.
"""

from __future__ import annotations

import errno
import os
import re
import json
import shutil
from contextlib import contextmanager
from typing import Any, Iterator, Optional

# Errors a user fixes by making room (or writing elsewhere), not by changing the program.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class WriteError(OSError):
    """Writing an output file failed; the message names the file and what to do."""


# Writers in Rust (safetensors) raise their own error class; the OS error is only in its
# message, as Rust's io::Error prints it: "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_in(err: BaseException) -> Optional[OSError]:
    """`err` itself if it is an OSError, else the first OSError it was raised from or
    during, or that a Rust writer's message reports (None when there is none: then it is
    not an I/O failure)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        rust = _RUST_OS_ERROR.search(str(err))
        if rust:
            code = int(rust.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def no_room_hint(err: OSError) -> str:
    return " (the disk is full or a size limit was reached: free space or write elsewhere)" \
        if err.errno in _NO_ROOM else ""


def write_error(err: OSError, path: str) -> WriteError:
    """The one message for a failed write of `path` (an existing WriteError is kept)."""
    if isinstance(err, WriteError):
        return err
    reason = f"[Errno {err.errno}] {err.strerror}" if err.errno is not None else str(err)
    return WriteError(f"cannot write {path}: {reason}{no_room_hint(err)}")


def remove_path(path: str) -> None:
    """Remove a half-written file or directory; never raises (it runs while failing)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError:
        pass


@contextmanager
def written_or_removed(path: str, report_as: Optional[str] = None) -> Iterator[None]:
    """Run the body that writes `path` (a file or a temporary directory): on any failure,
    Ctrl-C included, `path` is removed; an I/O failure is raised as a WriteError naming
    `report_as` (default: `path`)."""
    try:
        yield
    except BaseException as err:
        remove_path(path)
        found = os_error_in(err) if isinstance(err, Exception) else None
        if found is not None:
            raise write_error(found, report_as or path) from None
        raise


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # some file systems do not allow opening directories; nothing to sync then
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def replaced_atomically(path: str, durable: bool = False) -> Iterator[str]:
    """Write `path` whole or not at all: the body writes the yielded temporary name (in the
    same directory, with the same extension, so a writer that infers the format from it
    still does), which replaces `path` only once the body has finished. On a failure the
    temporary file is removed, `path` keeps its earlier content, and an I/O failure is a
    WriteError naming `path`. `durable`: fsync the file and its directory (survives a power
    loss, not only a crash of the process)."""
    directory, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(directory, f"{stem}.tmp.{os.getpid()}{ext}")
    with written_or_removed(tmp, report_as=path):
        yield tmp
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    if durable:
        fsync_dir(directory)


def write_text(path: str, text: str, durable: bool = False) -> None:
    """`path` holds `text` afterwards, or its earlier content (see `replaced_atomically`)."""
    with replaced_atomically(path, durable) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_json(path: str, value: Any, **dump_options) -> None:
    """`path` holds `value` as JSON afterwards, or its earlier content."""
    write_text(path, json.dumps(value, **dump_options))


def save_figure(fig, path: str, **savefig_options) -> None:
    """A matplotlib figure saved to `path` whole, or the earlier plot kept."""
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, **savefig_options)
