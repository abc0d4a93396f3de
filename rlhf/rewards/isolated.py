"""Reward functions in a process of their own (``reward.isolate=true``, the default).

The driver coordinates the whole run: a reward function that calls ``os._exit``, crashes in C code
(SIGSEGV), allocates without bound or calls ``sys.exit`` must not take it down with it, or the
run would end with no message, a stale lock, a RUNNING MLflow run and orphaned Ray processes. So
the user's functions are imported and called in one long-lived child process of the driver:

    driver (Rewards._call) --("call", ref, prompts, responses, metadata)--> reward process
                           <--("ok", [float, ...]) | ("error", one line)---

One message each way per function and step (a step's samples are one call), over a socketpair
(``multiprocessing.connection`` framing, pickle): the overhead is the pickling of the texts,
well under a millisecond for a few hundred samples. When the process ends during a call, the
call's future gets a ``RewardError`` naming the function and how it ended (exit code, signal);
the loop checkpoints the steps done and the run stops with that line (``rlhf.run``: lock
released, MLflow FAILED, cluster shut down). The process sets for itself:

* a memory cap (``reward.memory_gb``, ``RLIMIT_DATA``: the heap and private writable mappings, so
  an allocation past it raises MemoryError inside the function instead of growing into the
  machine's OOM killer; not ``RLIMIT_AS``, which counts address space that torch/CUDA reserve
  without using it),
* its own session (a terminal's Ctrl-C goes to the driver, which finishes the step; the reward
  call it waits on must not die under it),
* death with the driver (``PR_SET_PDEATHSIG``: SIGKILLed when the driver dies however it dies).

It runs the project's interpreter with the driver's ``sys.path``, working directory and
environment: a reward function is the user's own code and uses their packages, files and keys.
That is why it is not ``rlhf.agent.sandbox``'s pool, which is built for model-written code
(system ``python3 -I -S`` without the venv, a cleared environment, an unprivileged uid, a fresh
process per call): none of those fit a function that imports the user's packages and keeps
state (a loaded verifier) between calls.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from rlhf.rewards.calls import RewardError, accepted, call_user, load_function, raised_message, to_floats
from rlhf.spec.errors import UserError

_CRASH_SIGNALS = {"SIGSEGV": "a segmentation fault", "SIGBUS": "a bus error", "SIGILL": "an illegal instruction",
                  "SIGFPE": "a floating-point exception", "SIGABRT": "an abort"}


def memory_cap_gb(memory_gb: Optional[float]) -> float:
    """``reward.memory_gb`` as GB: None is half this machine's memory; 0 is no cap."""
    if memory_gb is not None:
        return float(memory_gb)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 / 2**30
    except (ValueError, OSError, AttributeError):  # not reported here: no cap
        return 0.0


def died_message(ref: str, returncode: int, during: str = "") -> str:
    """The line for a reward process that ended (``returncode`` as ``Popen`` reports it) during a
    call (``during``: while importing it)."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        if sig in _CRASH_SIGNALS:
            what = (f"crashed its process ({sig}, {_CRASH_SIGNALS[sig]}: in C code it calls, e.g. an extension "
                    "module or ctypes)")
        elif sig == "SIGKILL":
            what = "had its process killed (SIGKILL: the machine ran out of memory, or another process killed it)"
        else:
            what = f"had its process ended by {sig}"
    else:
        what = (f"ended its process (exit code {returncode}: os._exit or a C library's exit()); a reward function "
                "returns its scores")
    return f"reward function {ref} {what}{during}."


class ProcessExecutor:
    """Runs reward functions in one child process (see the module docstring); the same interface
    as ``rlhf.rewards.loader.ThreadExecutor``: ``load(ref)``, ``submit(rf, ...) -> Future``, ``close()``.
    The process starts at the first ``load``; after it died it is started again (its functions
    imported again) at the next call."""

    def __init__(self, memory_gb: Optional[float] = None):
        self.memory_gb = memory_cap_gb(memory_gb)
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._refs: list[str] = []  # imported in the process, in order (imported again after a restart)
        self._running: Optional[concurrent.futures.Future] = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def load(self, ref: str) -> Optional[tuple[str, ...]]:
        """Import ``ref`` in the reward process: the metadata names it takes (``calls.accepted``);
        UserError naming it when it does not import or ends the process while importing."""
        with self._lock:
            self._ensure()
            taken = self._load(ref)
            self._refs.append(ref)
            return taken

    def submit(self, rf: Any, prompts: list[str], responses: list[str], kwargs: dict) -> concurrent.futures.Future:
        with self._lock:
            if self._running is not None and not self._running.done():
                self._kill()  # the last call was given up (past reward.timeout_s) and may still run
            self._ensure()
            conn, proc = self._conn, self._proc
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_running_or_notify_cancel()
            self._running = fut

        def talk() -> None:  # a daemon thread: the caller waits on the future with its timeout
            try:
                conn.send(("call", rf.ref, prompts, responses, kwargs))
                kind, payload = conn.recv()
            except (EOFError, OSError):
                fut.set_exception(RewardError(died_message(rf.ref, proc.wait())))
                return
            except BaseException as e:  # noqa: BLE001 - e.g. metadata that does not pickle
                fut.set_exception(RewardError(f"reward function {rf.ref}: its arguments could not be sent to the "
                                              f"reward process ({type(e).__name__}: {e})."))
                return
            if kind == "ok":
                fut.set_result(payload)
            else:
                fut.set_exception(RewardError(payload))

        threading.Thread(target=talk, name="reward-process", daemon=True).start()
        return fut

    def close(self) -> None:
        with self._lock:
            self._kill()

    # -- the process

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._kill()
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the dir holding the rlhf package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p]))
        cap = int(self.memory_gb * 2**30)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", f"from rlhf.rewards.isolated import serve; serve({theirs.fileno()}, {cap}, "
                 f"{os.getpid()})"],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(("init", list(sys.path)))
        for ref in self._refs:
            self._load(ref)

    def _load(self, ref: str) -> Optional[tuple[str, ...]]:
        try:
            self._conn.send(("load", ref))
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            self._kill()
            raise UserError(died_message(ref, code, " while it was imported")) from None
        if kind != "ok":
            raise UserError(payload)
        return payload

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()


# ----------------------------------------------------------------------------- the reward process


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the driver dies (Linux); gone already: exit now."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed socket ends the process at its next read
        pass
    if os.getppid() != parent:
        os._exit(0)


def serve(fd: int, memory_bytes: int, parent: int) -> None:
    """The reward process: import functions and call them, as the driver asks, until it hangs up."""
    _die_with_parent(parent)
    if memory_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    memory_gb = memory_bytes / 2**30 if memory_bytes > 0 else None
    conn = Connection(fd)
    fns: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "init":
            sys.path[:] = msg[1]
            continue
        ref = msg[1]
        if kind == "load":
            try:
                fns[ref] = load_function(ref)
                reply = ("ok", accepted(fns[ref]))
            except UserError as e:
                reply = ("error", str(e))
            except BaseException as e:  # noqa: BLE001 - sys.exit at import time too
                reply = ("error", f"reward function {ref!r}: importing it failed: {type(e).__name__}: {e}".split("\n")[0])
        else:
            _, _, prompts, responses, kwargs = msg
            try:
                reply = ("ok", to_floats(ref, call_user(fns[ref], (prompts, responses), kwargs)))
            except RewardError as e:
                reply = ("error", str(e))
            except BaseException as e:  # noqa: BLE001 - sys.exit inside the function too
                reply = ("error", raised_message(ref, e, memory_gb))
        conn.send(reply)
