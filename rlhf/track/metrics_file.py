"""``<run_dir>/metrics.jsonl``: one JSON line per step, appended and on disk before the next step.

A write the filesystem refuses (disk full, quota, read-only) is a ``rlhf.storage.StorageError``
naming the file and the bytes the line needs, and never leaves half a line behind (the file is cut
back to its last whole line, so a resumed run can read it). A run dir deleted under a running run
is noticed at the next write (the file at the path is no longer the one this run appends to),
instead of the run going on into a file nobody can see.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from rlhf import storage
from rlhf.quoting import resume_command


class MetricsFile:
    """Append-only JSON lines, each written with one ``os.write`` (no buffer to flush later)."""

    def __init__(self, run_dir: str | os.PathLike, name: str = "metrics.jsonl"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        with storage.writing(self.path, "the metrics", self.run_dir):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._ino = os.fstat(self._fd).st_ino

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps(row) + "\n").encode()
        self._check_still_there()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[_write(self._fd, view):]
        except Exception as e:  # storage.writing's line; rlhf.storage is needed only when a write fails
            error = storage.refused(e, self.path, "the metrics", self.run_dir, needs=len(data),
                                    cleanup=lambda: self._cut(end))
            if error is None:
                raise
            raise error from None

    def _cut(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def _check_still_there(self) -> None:
        try:
            same = os.stat(self.path).st_ino == self._ino
        except FileNotFoundError:
            same = False
        if same:
            return
        if not self.run_dir.is_dir():
            raise storage.StorageError(storage.message("gone", "the metrics", self.path, self.run_dir,
                                                       "the file this run appends to is gone"))
        raise storage.StorageError(
            f"{self.path} was deleted or replaced during the run (by a cleanup script, or another program). "
            f"{storage.intact(self.run_dir)} Continue with {resume_command(self.run_dir)}.")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write(fd: int, data: memoryview) -> int:
    n = os.write(fd, data)
    if n == 0:  # no progress and no errno: treat as the disk being full, rather than loop
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return n
