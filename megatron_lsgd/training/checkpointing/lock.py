"""One writer per save directory: a lock file that two runs cannot both hold.

`<save>/.save.lock` is locked with `flock` for as long as the run lives. The kernel drops
the lock when the process dies (even by SIGKILL), so a lock left by a dead run is stale by
construction and the next run takes it over. The file also names its holder (host, pid,
start time, command) so the run that is refused can say who is in the way.

File systems without `flock` support (some Lustre/NFS mounts answer ENOLCK/ENOSYS) fall
back to the file's content: a holder on this host is alive if its pid is; a holder on
another host cannot be checked from here, so the run stops and names the file to delete.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from typing import Optional

from megatron_lsgd.training.checkpointing.errors import CheckpointError

LOCK_NAME = ".save.lock"
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


def _describe(owner: dict) -> str:
    if not owner:
        return "a run that has not written its name yet"
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')}, "
            f"command: {owner.get('command', '?')}")


def _read_owner(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists but not ours, or unreadable: assume alive (refusing is the safe side)
    return True


class SaveLock:
    """`acquire()` or raise CheckpointError naming the directory and the other run;
    `release()` removes the file. Hold it from start-up to exit."""

    def __init__(self, directory: str, flag: str = "--save"):
        self.directory = directory
        self.flag = flag
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: Optional[int] = None
        self._created_dir = False

    def _owner_record(self) -> bytes:
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:400]}
        return json.dumps(record).encode()

    def _refuse(self, owner: dict, extra: str = "") -> CheckpointError:
        return CheckpointError(
            f"{self.flag} {self.directory} is in use by another run ({_describe(owner)}). Two runs saving to one "
            f"directory would overwrite each other's checkpoints: wait for that run to end or choose another "
            f"directory{extra}")

    def acquire(self) -> None:
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.flag} {self.directory} is a file, not a directory")
        if not os.path.isdir(self.directory):
            try:
                os.makedirs(self.directory)
                self._created_dir = True
            except FileExistsError:
                pass
            except OSError as err:
                raise CheckpointError(f"{self.flag} {self.directory}: cannot create the directory ({err})") from err
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise CheckpointError(f"{self.flag} {self.directory} is not writable ({err})") from err
            if fcntl is None:
                self._fallback(fd)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(_read_owner(self.path)) from None
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise CheckpointError(f"{self.flag} {self.directory}: cannot lock {self.path} ({err})") from err
                self._fallback(fd)
                return
            # The holder before us may have deleted the file between our open and our flock:
            # then we locked an orphan inode and must start over on the current file.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._write_owner(fd)

    def _fallback(self, fd: int) -> None:
        """No flock here: decide from the recorded holder."""
        owner = _read_owner(self.path)
        if owner and owner.get("pid") != os.getpid():
            if owner.get("host") == socket.gethostname():
                if _pid_alive(owner.get("pid")):
                    os.close(fd)
                    raise self._refuse(owner)
            else:
                os.close(fd)
                raise self._refuse(owner, f"; this file system does not support locks, so a run on another host "
                                          f"cannot be checked from here: if it has ended, delete {self.path}")
        self._write_owner(fd)

    def _write_owner(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._owner_record(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so nobody takes over a file about to vanish
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._created_dir:
            try:
                os.rmdir(self.directory)  # only if still empty: a run that saved nothing leaves nothing
            except OSError:
                pass

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "SaveLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
