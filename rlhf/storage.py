"""Writes into the run dir that the filesystem refuses: disk full, over quota, read-only, gone.

``with writing(path, what, run_dir, needs=..., cleanup=...)`` around a write (in the driver, or a
Ray call whose workers write) turns such a failure into a ``StorageError``: one line naming what was
being written and where, the bytes it needs (where known) and the bytes free, the newest checkpoint
that is still intact, and the fix. ``cleanup`` runs first (it removes the partial write, which also
gives the space back). ``rlhf.run`` prints the line and exits 1.

Libraries hide the errno in places: torch's zip writer says "unexpected pos" or "file write failed",
safetensors "StorageFull", sqlite "database or disk is full", and a Ray worker's error arrives
wrapped (``.cause``); ``kind_of`` looks through all of them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

from rlhf.quoting import resume_command

FULL = {errno.ENOSPC, errno.EDQUOT}
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
GONE = {errno.ENOENT, errno.ESTALE}
FULL_TEXT = ("no space left on device", "disk quota exceeded", "storagefull", "quotaexceeded",
             "database or disk is full")
READ_ONLY_TEXT = ("read-only file system", "readonlyfilesystem")
TORCH_WRITE_TEXT = ("file write failed", "unexpected pos")  # torch.save on a full disk
LOW_SPACE = 1 << 20  # a write failure with less than this free is a full disk


class StorageError(Exception):
    """The run dir refused a write (disk full, quota, read-only, deleted): one line, exit code 1."""

    exit_code = 1


def _oserrors(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    queue: list = [e]
    while queue:
        x = queue.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        queue += [getattr(x, "cause", None), x.__cause__, x.__context__]  # .cause: Ray's RayTaskError


def kind_of(e: BaseException, run_dir: str | os.PathLike | None = None) -> Optional[str]:
    """'full', 'read-only', 'gone', 'write-failed' (torch's errno-less write error) or None. A
    missing file counts as 'gone' only when ``run_dir`` (if given) is gone too."""
    codes = {x.errno for x in _oserrors(e) if isinstance(x, OSError)}
    if run_dir is not None and Path(run_dir).is_dir():
        codes -= GONE
    for kind, group in (("full", FULL), ("read-only", READ_ONLY), ("gone", GONE)):
        if codes & group:
            return kind
    text = " ".join(str(x) for x in _oserrors(e)).lower()
    if any(t in text for t in FULL_TEXT):
        return "full"
    if any(t in text for t in READ_ONLY_TEXT):
        return "read-only"
    if any(t in text for t in TORCH_WRITE_TEXT):
        return "write-failed"
    return None


def reason_of(e: BaseException) -> str:
    """The short cause: the OSError's text, else the line of the message that says what failed."""
    for x in _oserrors(e):
        if isinstance(x, OSError) and x.strerror:
            return x.strerror
    lines = [ln.strip() for x in _oserrors(e) for ln in str(x).splitlines() if ln.strip()]
    for ln in lines:
        if any(t in ln.lower() for t in FULL_TEXT + READ_ONLY_TEXT + TORCH_WRITE_TEXT):
            return ln[-200:]
    return (lines[-1] if lines else type(e).__name__)[-200:]


def nearest_existing(path: str | os.PathLike) -> Optional[Path]:
    """``path`` or its nearest parent that exists (where a dir not made yet will be written)."""
    p = Path(path).absolute()
    return next((q for q in [p, *p.parents] if q.exists()), None)


def free_bytes(path: str | os.PathLike) -> Optional[int]:
    """Free bytes (for this user) on the filesystem of ``path`` or its nearest existing parent."""
    q = nearest_existing(path)
    if q is None:
        return None
    try:
        return shutil.disk_usage(q).free
    except OSError:
        return None


def dir_bytes(path: str | os.PathLike) -> int:
    """The total size of the files under ``path`` (0 when it does not exist)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def unit_of(n: float) -> tuple[str, float]:
    """The unit ``human`` prints ``n`` bytes in, and its size in bytes."""
    return next(((u, size) for u, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= size), ("bytes", 1))


def human(n: Optional[float]) -> str:
    """``n`` bytes as "12.3 GB" (GB, MB or kB, one decimal; else whole bytes); "?" when unknown."""
    if n is None:
        return "?"
    unit, size = unit_of(n)
    return f"{n / size:.1f} {unit}" if size > 1 else f"{int(n)} bytes"


def intact(run_dir: str | os.PathLike) -> str:
    """What a rerun can start from: the newest complete checkpoint, or none."""
    from rlhf.ckpt.manager import find_latest

    try:
        latest = find_latest(run_dir)
    except OSError:
        latest = None
    if latest is None:
        return "No checkpoint was written yet."
    return f"The checkpoint of step {latest.step} is intact ({latest.path})."


def message(kind: str, what: str, path: str | os.PathLike, run_dir: str | os.PathLike, reason: str,
            needs: Optional[int] = None, needs_what: str = "", free: Optional[int] = None) -> str:
    """The one line of a refused write (see the module docstring)."""
    if kind == "gone":
        return (f"the output dir {run_dir} disappeared during the run (deleted?) while writing {what} to {path} "
                f"({reason}). Its checkpoints went with it: start again with an output_dir that nothing cleans up.")
    if kind == "read-only":
        return (f"{path} could not be written ({reason}) while writing {what}: the output dir became read-only or "
                f"lost its permissions. {intact(run_dir)} Make {run_dir} writable again, then continue with "
                f"{resume_command(run_dir)}.")
    need = f"it needs {'about ' if needs_what else ''}{human(needs)}{f' ({needs_what})' if needs_what else ''}, " \
        if needs else ""
    head = "disk full" if kind == "full" else "write failed (most likely a full disk)"
    return (f"{head} while writing {what} to {path} ({reason}): {need}{human(free)} free there. {intact(run_dir)} "
            f"Free space (or give output_dir= on a larger disk), then continue with {resume_command(run_dir)}.")


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str, run_dir: str | os.PathLike, needs: Optional[int] = None,
            needs_what: str = "", cleanup: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Turn a refused write inside the block into a StorageError (see the module docstring)."""
    try:
        yield
    except StorageError:
        if cleanup is not None:
            cleanup()
        raise
    except Exception as e:
        error = refused(e, path, what, run_dir, needs, needs_what, cleanup)
        if error is None:
            raise
        raise error from None


def refused(e: Exception, path: str | os.PathLike, what: str, run_dir: str | os.PathLike, needs: Optional[int] = None,
            needs_what: str = "", cleanup: Optional[Callable[[], None]] = None) -> Optional[StorageError]:
    """The StorageError for ``e``, raised by a write of ``what`` to ``path``, after ``cleanup``; None
    when ``e`` is no refused write. What ``writing`` raises, for a writer that catches the error
    itself (``rlhf.track.metrics_file``: a line every step, with nothing to do here unless it fails)."""
    kind = kind_of(e, run_dir)
    if kind is None:
        return None
    free = free_bytes(path)  # before cleanup gives the partial write's space back
    if kind == "write-failed" and free is not None and free < max(needs or 0, LOW_SPACE):
        kind = "full"
    if cleanup is not None:
        try:
            cleanup()
        except OSError:
            pass
    return StorageError(message(kind, what, path, run_dir, reason_of(e), needs, needs_what, free))


def uncaught(e: BaseException, run_dir: str | os.PathLike) -> Optional[str]:
    """The line for a refused write that no ``writing`` block caught (a full disk anywhere, or a
    read-only / deleted run dir), else None."""
    kind = kind_of(e, run_dir)
    if kind is None or kind == "write-failed":
        return None
    where = next((x.filename for x in _oserrors(e) if isinstance(x, OSError) and x.filename), None)
    inside = where is not None and Path(os.path.abspath(where)).is_relative_to(Path(run_dir).absolute())
    if kind != "full" and not inside:
        return None  # a permission problem elsewhere (a model dir, a data file) is not the run dir's
    if where is None:  # ENOSPC without a path: the run dir, or Ray's temp dir, or a cache
        return (f"disk full ({reason_of(e)}): the run dir {run_dir} has {human(free_bytes(run_dir))} free; Ray's "
                f"temp dir (/tmp/ray) and the caches are other places it writes. {intact(run_dir)} Free space, then "
                f"continue with {resume_command(run_dir)}.")
    return message(kind, "the run's files", where, run_dir, reason_of(e), free=free_bytes(where))


def _sibling(final: Path) -> Path:
    """A new hidden dir beside ``final``, with the permissions a plain mkdir would give it:
    mkdtemp's 0700 would follow the rename and hide the model from other users, and a group-shared
    parent's setgid bit (group inheritance) is kept."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    mode = 0o777 & ~_umask()
    os.chmod(tmp, mode | (final.parent.stat().st_mode & stat.S_ISGID))
    return tmp


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, briefly, for every
    thread of the process)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Optional[Path]]:
    """Yield a temporary sibling dir to fill, then rename it to ``final``.

    Yields None when ``final`` already exists. If another process renames first, ours is dropped.
    """
    final = Path(final)
    if final.exists():
        yield None
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(final)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def publish(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling dir to fill, then put it in place of ``final`` (an older ``final``
    is replaced): a reader, or a run killed mid-write, sees the whole dir or none of it. An
    exception inside the block removes the temporary dir and leaves ``final`` as it was. What an
    earlier writer killed part way left beside ``final`` (``.<name>.*``) is removed first: one
    process writes ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = _sibling(final)
    try:
        yield tmp
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
