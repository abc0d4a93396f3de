"""Every worker process's output in its own file: ``<run dir>/logs/<role>_<rank>.log``.

A worker calls ``log_to_file`` first thing (rlhf.workers.base.Worker): its file descriptors 1 and
2 are pointed at the file (``os.dup2``), so everything it and its children print lands there —
Python's logging and warnings, vLLM's INFO lines and its engine-core subprocess, DeepSpeed, NCCL
and c10d messages written from C++, Liger's import errors — and Ray has nothing left to forward to
the driver's console. The console then holds the run's own lines (rlhf/run.py, the loops).

One process can host several roles (CPU hybrid placement: ``rlhf.launch.group.Host``): the file
is renamed as roles join it, ``actor+reference+rollout_0.log``; the open descriptor follows.

``tracking.console=verbose`` leaves the descriptors alone: every worker's output reaches the console
through Ray as before (and no file is written). On several nodes each node writes the files of
its own workers under the same path (the run dir of a shared filesystem, else that node's disk).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from rlhf.spec.runspec import RunSpec

LOG_DIR = "logs"
_claimed: dict[str, object] = {}  # this process's file: {"path": Path, "roles": [..], "rank": int}
_original: list[int] = []  # copies of descriptors 1 and 2 as the process started (restore_output)


def log_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOG_DIR


def quiet(spec: RunSpec) -> bool:
    return spec.tracking.console != "verbose"


def log_to_file(spec: RunSpec, role: str, rank: int) -> Optional[Path]:
    """Send this process's stdout and stderr to its log file (once per process); the file's path,
    or None with ``tracking.console=verbose``."""
    if not quiet(spec) or not getattr(spec, "run_dir", None):
        return None
    folder = log_dir(spec.run_dir)
    if _claimed and Path(_claimed["path"]).parent == folder:  # type: ignore[arg-type]
        return _join(role)
    _claimed.clear()  # (a process of an earlier run in this Ray cluster: this run's folder now)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role}_{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    if not _original:  # the process's own output (Ray's log files of the worker), for restore_output
        _original.extend((os.dup(1), os.dup(2)))  # not inherited by children (os.dup's default)
    try:
        os.dup2(fd, 1)  # dup2's copies are inheritable: child processes write here too
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    _line_buffered()
    _claimed.update(path=path, roles=[role], rank=rank)
    print(f"# {role} rank {rank} · pid {os.getpid()} · {socket.gethostname()} · "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    return path


def restore_output() -> None:
    """Point descriptors 1 and 2 back where they were before ``log_to_file`` (a host kept idle
    between runs, ``rlhf.launch.pool``, writes nothing more into the finished run's files)."""
    if not _claimed:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if _original:
        os.dup2(_original[0], 1)
        os.dup2(_original[1], 2)
    _claimed.clear()


def _join(role: str) -> Path:
    roles: list = _claimed["roles"]  # type: ignore[assignment]
    path: Path = _claimed["path"]  # type: ignore[assignment]
    if role in roles:
        return path
    roles.append(role)
    new = path.with_name(f"{'+'.join(roles)}_{_claimed['rank']}.log")
    try:
        os.rename(path, new)  # the descriptors stay open on the renamed file
        _claimed["path"] = new
    except OSError:  # a file of that name already there (a resumed run): keep appending to the old one
        new = path
    print(f"# also {role} rank {_claimed['rank']} in this process", flush=True)
    return new


def _line_buffered() -> None:
    """A crash keeps the last lines: Python's streams flush at each newline."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):  # a stream replaced by something else
            pass


def tail_for_pid(spec: RunSpec, pid: int, nbytes: int = 65536) -> str:
    """The end of the log file of process ``pid`` of this run ("" when none): what a worker that
    died wrote last (torch's NCCL watchdog prints its cause on stderr, then ends the process)."""
    try:
        for path in log_dir(spec.run_dir).glob("*.log"):
            with open(path, "rb") as f:
                if f" · pid {pid} · ".encode() not in f.readline():
                    continue
                f.seek(max(0, os.path.getsize(path) - nbytes))
                return f.read().decode(errors="replace")
    except (OSError, AttributeError):
        pass
    return ""


def tail_for_actor(spec: RunSpec, actor_id: str) -> str:
    """``tail_for_pid`` of a Ray actor's process (its pid from Ray's state API); "" when unknown."""
    try:
        from ray._private import state

        pid = (state.actors(actor_id=actor_id) or {}).get("Pid")
    except Exception:  # noqa: BLE001 - Ray not up, or no such actor
        return ""
    return tail_for_pid(spec, pid) if pid else ""


def where(spec: RunSpec) -> str:
    """For an error line: where the workers' own account of it is."""
    if not quiet(spec) or not getattr(spec, "run_dir", None):
        return ""
    return f" Worker logs: {log_dir(spec.run_dir)}/"


def latest_line(run_dir: str | os.PathLike, width: int = 90) -> str:
    """``<file stem>: <its last line>`` of the log written to most recently ("" when none): what the
    workers are doing now, for the console's status while the cluster starts."""
    try:
        files = sorted(log_dir(run_dir).glob("*.log"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return ""
    for path in reversed(files):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                tail = f.read().decode(errors="replace")
        except OSError:
            continue
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", tail) if ln.strip() and not ln.startswith("#")]
        if lines:
            line = _ANSI.sub("", lines[-1])
            text = f"{path.stem}: {line}"
            return text if len(text) <= width else text[:width - 1] + "…"
    return ""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# What a rollout worker prints of its engine kind's work before the engine starts (RolloutWorker.prepare)
ENGINE_IMPORTS = "rlhf: rollout engine imports took"
# What the workers' libraries say about their set-up and how long it took (vLLM's engine start).
SETUP_TIMES = [
    ("imports", re.compile(re.escape(ENGINE_IMPORTS) + r" ([\d.]+) s\b")),
    ("model load", re.compile(r"Model loading took .*?([\d.]+) ?s(?:econds)?\b")),
    ("weights", re.compile(r"Loading weights took ([\d.]+) ?s(?:econds)?\b")),
    ("torch.compile", re.compile(r"torch\.compile takes ([\d.]+) ?s in total")),
    ("CUDA graphs", re.compile(r"Graph capturing finished in ([\d.]+) ?secs?")),
    ("engine start", re.compile(r"init engine.*? took ([\d.]+) ?s(?:econds)?\b")),
]


def setup_times(run_dir: str | os.PathLike) -> dict[str, dict[str, float]]:
    """``{log stem: {phase: seconds}}`` from the worker logs (the last figure of each phase)."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(log_dir(run_dir).glob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for phase, pattern in SETUP_TIMES:
            found = pattern.findall(text)
            if found:
                out.setdefault(path.stem, {})[phase] = float(found[-1])
    return out


def setup_line(spec: RunSpec) -> str:
    """One console line: each worker's set-up phases with their seconds ("" when the logs name none)."""
    if not quiet(spec):
        return ""
    parts = [f"{who}: " + ", ".join(f"{phase} {s:.1f} s" for phase, s in phases.items())
             for who, phases in setup_times(spec.run_dir).items()]
    return ("set-up · " + " · ".join(parts)) if parts else ""
