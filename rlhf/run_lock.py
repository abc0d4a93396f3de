"""One live run per output dir, and one creator of a shared file at a time.

``RunLock(run_dir)`` is ``<run_dir>/.rlhf-run.lock``: an exclusive ``flock`` held by the driver for
the whole run, with the owner's pid, host and start time in the file. The kernel drops a ``flock``
when its process dies however it dies (SIGKILL, OOM), so a lock file that exists but is not locked
is stale: the next run takes it over with a warning. A lock held by a live process stops the new
run with one line naming the owner (``UserError``, exit 2). The file is removed when the run ends.

``file_lock(path)`` serialises short critical sections between processes (the creation of the
MLflow sqlite store, ``rlhf.track.tracker``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator, Optional

from rlhf.spec.errors import UserError

LOCK_NAME = ".rlhf-run.lock"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace")
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def describe(owner: dict) -> str:
    """'pid 123 on host box (started 2026-01-02 10:11:12, rlhf-run ...)' from a lock's contents."""
    if not owner:
        return "another process (it has not written its pid yet)"
    out = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
    if owner.get("started"):
        out += f" (started {owner['started']})"
    return out


class RunLock:
    """The exclusive lock of one run dir; ``acquire()`` before writing anything into it."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Optional[dict]:
        """Take the lock; returns the previous owner's record when a stale lock was taken over
        (and prints a warning), else None. Raises UserError when a live run holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in _BUSY:  # a filesystem without flock: decide by the pid alone
                    return self._acquire_by_pid(fd)
                owner = self._owner_of(fd)
                os.close(fd)
                raise UserError(
                    f"output_dir={self.run_dir} is in use by another run: {describe(owner)}. Give this run "
                    "another output_dir=<path>, or wait for that one to finish (a run dir belongs to one "
                    f"live run; {self.path} is its lock)."
                ) from None
            # the previous owner may have removed the file between our open and our lock: then ours
            # is an orphan that nobody else can see, so lock the file that is there now instead
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            return self._take(fd, _read(fd))

    def _owner_of(self, fd: int) -> dict:
        """The holder's record; it writes it right after locking, so wait a moment for it."""
        for _ in range(20):
            owner = _read(fd)
            if owner:
                return owner
            time.sleep(0.05)
        return {}

    def _acquire_by_pid(self, fd: int) -> Optional[dict]:
        previous = _read(fd)
        pid, host = previous.get("pid"), previous.get("host")
        if previous and (host != socket.gethostname() or (pid is not None and _alive(int(pid)))):
            os.close(fd)
            raise UserError(
                f"output_dir={self.run_dir} is in use by another run: {describe(previous)}. Give this run another "
                f"output_dir=<path>, or wait for that one to finish (or delete {self.path} if it is gone)."
            )
        return self._take(fd, previous)

    def _take(self, fd: int, previous: dict) -> Optional[dict]:
        """Hold the lock through ``fd`` with this run's record; a stale owner's record is returned
        (and named in a warning)."""
        self._write(fd)
        self._fd = fd
        if previous:
            print(f"warning: output_dir={self.run_dir} was locked by {describe(previous)}, which is no longer "
                  "running: taking it over.", file=sys.stderr, flush=True)
            return previous
        return None

    def _write(self, fd: int) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now().strftime("%Y-%m-%d %H:%M:%S"), "argv": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(record) + "\n").encode())

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one locks a file about to vanish)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:  # the run dir is gone or read-only: the lock dies with this fd anyway
            pass
        os.close(fd)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, timeout_s: float = 300.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in _BUSY:
                    break  # no flock on this filesystem: go on unlocked, as before
                if time.monotonic() > deadline:
                    raise UserError(f"{path} stayed locked by another process for {timeout_s:.0f} s. If no other "
                                    f"run is starting, delete {path} and try again.") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
