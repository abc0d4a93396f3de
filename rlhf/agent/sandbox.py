"""Run model-written Python in a throwaway process, one process per call, from a bounded pool.

Each call starts a fresh interpreter (the system ``python3``, standard library only) that reads its
code from stdin, runs it in an empty working directory and is killed when it passes a limit:

    cpu_s        RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL one second later)
    memory_mb    RLIMIT_AS: an allocation past it fails inside the process (MemoryError)
    wall_s       the host kills the whole sandbox after this many seconds
    output_bytes the host kills it once stdout + stderr pass this many bytes (what came is kept)
    processes    RLIMIT_NPROC: forks past it fail (EAGAIN); a fork bomb ends on its own errors
    disk_mb      the size of the working directory (a tmpfs under bwrap) and RLIMIT_FSIZE

How much of the host it can see depends on the isolation found on this machine (``isolation``;
``detect_isolation`` probes once per process, docs/agent.md lists what each level guarantees):

    bwrap    bubblewrap: new user, pid, net, ipc, uts and mount namespaces; the filesystem is only
             /usr (read-only) and an empty tmpfs working dir; no network device but loopback of its
             own; the host's processes are invisible. The strongest level, used when it works.
    unshare  util-linux ``unshare``: new user, pid, net, ipc and uts namespaces; the host filesystem
             stays visible with the sandbox uid's permissions; the working dir is a host temp dir.
    none     rlimits and the unprivileged uid only: the network is reachable. Only for machines
             where neither works; ``SandboxPool(isolation="bwrap")`` refuses to start instead.

As root (CI, containers) every pool slot runs as its own unprivileged uid (from ``uid_base``, leased
by the pool alone: ``_UidLease``), so
the sandbox cannot read root's files or signal the host's processes, RLIMIT_NPROC counts only its
own processes, and whatever is left after a call is killed by that uid. The environment is cleared
(PATH, HOME, LANG only), so no secret in the host's environment reaches the code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from rlhf.spec.errors import UserError

ISOLATIONS = ("bwrap", "unshare", "none")
KILL_CAUSES = ("cpu", "memory", "wall", "output", "processes", "signal")
UID_BASE = 61000
WORKDIR = "/work"  # the working dir's path inside a bwrap sandbox


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    output_bytes: int = 64 * 1024
    processes: int = 32
    disk_mb: int = 64


@dataclass
class SandboxResult:
    """What one call produced. ``killed`` names the limit that ended it (one of KILL_CAUSES; a
    MemoryError or failed fork counts even when the code caught nothing and just died of it)."""

    stdout: str
    stderr: str
    exit_code: Optional[int]  # None when the host killed it; -N for signal N
    killed: Optional[str] = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    isolation: str = "none"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    def error_text(self) -> str:
        """One line for the model: why the call failed ("" when it did not)."""
        if self.killed == "wall":
            return f"timed out after {self.wall_s:.1f} s (wall-clock limit)"
        if self.killed == "cpu":
            return f"killed: CPU time limit ({self.cpu_s:.1f} s used)"
        if self.killed == "memory":
            return "killed: memory limit (MemoryError)"
        if self.killed == "output":
            return "killed: output limit (stdout + stderr too large)"
        if self.killed == "processes":
            return "killed: process limit (fork failed)"
        if self.killed == "signal":
            return f"killed by signal {-(self.exit_code or 0)}"
        if self.exit_code not in (0, None):
            return f"exited with status {self.exit_code}"
        return ""


# The program each sandbox runs (``python3 -I -S -c RUNNER``): read the payload, write the files,
# lower the limits (an unprivileged process cannot raise them again), run the code as __main__.
# A MemoryError or a failed fork is reported on the status pipe, which the code could also write
# to: that would only mislabel its own failure, never the host's view of its limits.
RUNNER = r"""
import json, os, resource, sys, traceback
main_pid = os.getpid()
p = json.loads(sys.stdin.buffer.read())
sys.stdin = open(os.devnull)
status = os.fdopen(p["status_fd"], "w")
os.chdir(p["workdir"])
for name, text in p["files"].items():
    with open(name, "w") as f:
        f.write(text)
L = p["limits"]
def lim(kind, soft, hard=None):
    try:
        resource.setrlimit(kind, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass
lim(resource.RLIMIT_CORE, 0)
lim(resource.RLIMIT_CPU, L["cpu_s"], L["cpu_s"] + 1)
lim(resource.RLIMIT_FSIZE, L["disk_mb"] << 20)
lim(resource.RLIMIT_NOFILE, 256)
if L["processes"] > 0:
    lim(resource.RLIMIT_NPROC, L["processes"])
lim(resource.RLIMIT_AS, L["memory_mb"] << 20)
sys.argv = ["main.py"]
outcome = "ok"
try:
    exec(compile(p["code"], "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    outcome = "ok" if code == 0 else "exit"
except MemoryError:
    outcome = "memory"
    sys.stderr.write("MemoryError: the sandbox's memory limit was reached\n")
except BlockingIOError as e:
    outcome = "processes"
    sys.stderr.write("BlockingIOError: %s (the sandbox's process limit)\n" % e)
except BaseException:
    outcome = "error"
    traceback.print_exc()
try:
    sys.stdout.flush(); sys.stderr.flush()
    if os.getpid() == main_pid:  # forked children of the code end here too: only the runner reports
        status.write(outcome); status.flush()
except BaseException:
    pass
os._exit(0 if outcome == "ok" else (code if outcome == "exit" else 1))
"""


def system_python() -> str:
    """The interpreter sandboxes run: the distribution's python3 (under /usr, readable by any uid
    and the only tree a bwrap sandbox sees), else this process's own."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    return sys.executable


def _is_root() -> bool:
    return os.geteuid() == 0


def _bwrap_argv(python: str, limits: SandboxLimits) -> list[str]:
    argv = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for link, target in (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin")):
        argv += ["--symlink", target, link]
    real = os.path.realpath(python)
    if not real.startswith("/usr/"):
        # an interpreter outside /usr: its installation tree, read-only (it must be readable by the sandbox uid)
        prefix = os.path.dirname(os.path.dirname(real))
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb << 20), "--tmpfs", WORKDIR,
             "--size", str(8 << 20), "--tmpfs", "/tmp", "--chdir", WORKDIR,
             "--remount-ro", "/", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--clearenv",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
    return argv + [python, "-I", "-S", "-c", RUNNER]


def _unshare_argv(python: str) -> list[str]:
    # --map-root-user: the user namespace lets an unprivileged uid create the others; the code is
    # "root" only inside it (no power over files or processes outside)
    return ["unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts",
            "--", python, "-I", "-S", "-c", RUNNER]


def _plain_argv(python: str) -> list[str]:
    return [python, "-I", "-S", "-c", RUNNER]


UID_RANGE = 4096  # uids a machine's sandboxes may take, from uid_base
_LEASES = "/tmp/rlhf-sandbox-uids"


class _UidLease:
    """An unprivileged uid this process holds alone (as root): an flock on ``<uid>.lock`` under
    /tmp/rlhf-sandbox-uids, kept while the lease lives and dropped by the kernel when the process
    ends. Two pools, in one process or in several (two pytest workers, two runs), never share a uid,
    so the kill of whatever a call left behind (by uid) never reaches another pool's sandbox."""

    def __init__(self, uid_base: int):
        import fcntl

        self.uid: Optional[int] = None
        self._fd: Optional[int] = None
        if not _is_root():
            return
        os.makedirs(_LEASES, mode=0o700, exist_ok=True)
        for uid in range(uid_base, uid_base + UID_RANGE):
            fd = os.open(os.path.join(_LEASES, f"{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise UserError(f"sandbox: all {UID_RANGE} uids from {uid_base} are taken by running sandboxes.")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.release()


def _live_pids(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies (a zombie holds no resources; its parent reaps it)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            out.append(int(entry))
    return out


def _kill_uid(uid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of ``uid`` (a pool slot's own uid: only this slot's sandbox has it),
    until none is left (a fork bomb may still be forking while the first ones die)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _live_pids(uid)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _run_once(isolation: str, python: str, limits: SandboxLimits, code: str, files: dict[str, str],
              uid: Optional[int]) -> SandboxResult:
    status_r, status_w = os.pipe()
    hostdir = None
    if isolation == "bwrap":
        argv, workdir, env = _bwrap_argv(python, limits), WORKDIR, None
    else:
        hostdir = tempfile.mkdtemp(prefix="rlhf-sandbox-")
        if uid is not None:
            os.chown(hostdir, uid, uid)
        os.chmod(hostdir, 0o700)
        workdir = hostdir
        env = {"PATH": "/usr/bin:/bin", "HOME": hostdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        argv = _unshare_argv(python) if isolation == "unshare" else _plain_argv(python)
    payload = json.dumps({"code": code, "files": files, "workdir": workdir, "status_fd": status_w,
                          "limits": dataclasses.asdict(limits)}).encode()
    kwargs = {}
    if uid is not None:
        kwargs = {"user": uid, "group": uid, "extra_groups": []}
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), env=env if env is not None else {}, cwd="/",
                                start_new_session=True, **kwargs)
    finally:
        os.close(status_w)
    killed: Optional[str] = None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    deadline = t0 + limits.wall_s
    try:
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        total = 0
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "wall"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                room = limits.output_bytes - total
                out[key.fd] += chunk[: max(room, 0)]
                total += len(chunk)
                if total > limits.output_bytes:
                    killed = "output"
                    break
            if killed:
                break
        sel.close()
        status = None
        rusage = None
        while killed is None:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() >= deadline:
                killed = "wall"
                break
            time.sleep(0.005)
        if killed is not None:
            _terminate(proc, uid)
            _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = 0  # reaped here; keeps Popen from waiting again
    finally:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        if uid is not None:
            _kill_uid(uid)  # anything that outlived the call (only possible without a pid namespace)
        if hostdir is not None:
            shutil.rmtree(hostdir, ignore_errors=True)
    with os.fdopen(status_r, "rb") as f:
        outcome = f.read(64).decode(errors="replace")
    wall = time.monotonic() - t0
    cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
    exit_code: Optional[int] = None
    if killed is None:
        exit_code = _exit_code(status, isolation)
        killed = _cause(exit_code, outcome, cpu, wall, limits)
    return SandboxResult(stdout=out[out_fd].decode(errors="replace"), stderr=out[err_fd].decode(errors="replace"),
                         exit_code=exit_code, killed=killed, wall_s=wall, cpu_s=cpu,
                         isolation=isolation)


def _terminate(proc: subprocess.Popen, uid: Optional[int]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session (start_new_session): the sandbox's launcher and children
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): its poll() would reap the pid that wait4 reads
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)


def _exit_code(status: int, isolation: str) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    code = os.WEXITSTATUS(status)
    if isolation == "bwrap" and code > 128:
        return -(code - 128)  # bwrap reports its child's death by signal N as 128 + N
    return code


def _cause(exit_code: int, outcome: str, cpu: float, wall: float, limits: SandboxLimits) -> Optional[str]:
    # the CPU limit shows as SIGXCPU (soft limit), SIGKILL (hard limit, when SIGXCPU was ignored) or,
    # through unshare (which cannot always re-raise SIGXCPU), as a failure with the CPU time spent;
    # under bwrap the host's rusage misses the code's CPU (its pid 1 does not report it), so the
    # hard limit's SIGKILL is read from the wall time, which is never shorter than the CPU time
    if exit_code < 0 and -exit_code == signal.SIGXCPU:
        return "cpu"
    if exit_code < 0 and -exit_code == signal.SIGKILL and max(cpu, wall) >= limits.cpu_s:
        return "cpu"
    if outcome == "memory":
        return "memory"
    if outcome == "processes":
        return "processes"
    if exit_code != 0 and cpu >= limits.cpu_s * 0.95:
        return "cpu"
    if exit_code < 0:
        return "signal"
    return None


@functools.lru_cache(maxsize=None)
def _probe(isolation: str, python: str, uid: Optional[int]) -> Optional[str]:
    """None when ``isolation`` runs a trivial program here, else why not (one line)."""
    if isolation != "none" and shutil.which(isolation) is None:
        return f"{isolation} is not installed"
    try:
        res = _run_once(isolation, python, SandboxLimits(wall_s=20.0), "print(6 * 7)", {}, uid)
    except OSError as e:
        return f"{isolation} could not start: {e}"
    if res.stdout.strip() != "42":
        why = (res.stderr.strip().splitlines() or [res.error_text() or "no output"])[-1]
        return f"{isolation} failed here: {why}"
    return None


def detect_isolation(python: Optional[str] = None, uid_base: int = UID_BASE) -> str:
    """The strongest isolation that works on this machine, as this user (probed once per process)."""
    py = python or system_python()
    lease = _UidLease(uid_base)
    try:
        for iso in ("bwrap", "unshare"):
            if _probe(iso, py, lease.uid) is None:
                return iso
        return "none"
    finally:
        lease.release()


class SandboxPool:
    """At most ``workers`` sandboxes at once; each call a fresh process (``run`` blocks the calling
    thread, ``run_async`` waits on the pool's threads, off the event loop)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), workers: int = 4, isolation: str = "auto",
                 python: Optional[str] = None, uid_base: int = UID_BASE):
        if isolation not in ("auto",) + ISOLATIONS:
            raise UserError(f"sandbox isolation {isolation!r} is not one of auto, {', '.join(ISOLATIONS)}.")
        if workers < 1:
            raise UserError(f"sandbox workers={workers}: use at least 1.")
        self.limits = limits
        self.python = python or system_python()
        self.uid_base = uid_base
        # one uid per slot, held by this pool alone (see _UidLease)
        self._leases = [_UidLease(uid_base) for _ in range(max(workers, 1))]
        if isolation == "auto":
            isolation = detect_isolation(self.python, uid_base)
        else:
            why = _probe(isolation, self.python, self._leases[0].uid)
            if why is not None:
                fix = "apt-get install bubblewrap, or " if why.endswith("not installed") and isolation == "bwrap" else ""
                raise UserError(f"sandbox isolation={isolation}: {why}. Fix: {fix}choose isolation=auto or another "
                                f"level ({', '.join(ISOLATIONS)}).")
        self.isolation = isolation
        self.workers = workers
        self._slots: queue.Queue[int] = queue.Queue()
        for s in range(workers):
            self._slots.put(s)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def run(self, code: str, files: Optional[dict[str, str]] = None,
            limits: Optional[SandboxLimits] = None) -> SandboxResult:
        """Run ``code`` (as ``main.py``, beside ``files``: name -> text) in a fresh sandbox."""
        slot = self._slots.get()
        try:
            return _run_once(self.isolation, self.python, limits or self.limits, code, dict(files or {}),
                             self._leases[slot].uid)
        finally:
            self._slots.put(slot)

    async def run_async(self, code: str, files: Optional[dict[str, str]] = None,
                        limits: Optional[SandboxLimits] = None) -> SandboxResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(self.run, code, files, limits))

    def map(self, codes: list[str], files: Optional[list[dict[str, str]]] = None,
            limits: Optional[SandboxLimits] = None) -> list[SandboxResult]:
        """Run each code in its own sandbox, ``workers`` at a time; results in order."""
        files = files or [{} for _ in codes]
        return list(self._executor.map(functools.partial(self._run_with, limits), codes, files))

    def _run_with(self, limits: Optional[SandboxLimits], code: str, files: dict[str, str]) -> SandboxResult:
        return self.run(code, files, limits)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


_DEFAULT: Optional[SandboxPool] = None


def default_pool() -> SandboxPool:
    """The process's shared pool (default limits, auto isolation, workers = CPU count, at most 8)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = SandboxPool(workers=max(1, min(8, os.cpu_count() or 1)))
    return _DEFAULT
