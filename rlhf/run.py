"""``execute(spec) -> exit code``: a built spec planned, or checked and run (``rlhf-run`` and every
sweep job call it); ``run(spec) -> exit code``: the run dir, tracking, the cluster, the loop;
cleanup always.

    run_dir/spec.yaml     the full resolved spec (derived batch plan and layout included)
    run_dir/config.yaml   the user-level config: ``rlhf-run -cp <run_dir> -cn config`` reruns it
    run_dir/metrics.jsonl one line of metrics per step
    run_dir/.rlhf-run.lock while the run lives: its pid and host (rlhf.run_lock; one live run per dir)

A refused write (disk full, quota, read-only or deleted run dir; ``rlhf.storage``) is one line and
exit code 1, the newest complete checkpoint kept. So is a worker that died, a rollout engine whose
vLLM core died, or a collective that timed out (``rlhf.launch.failures``: role, rank, GPUs, phase
and step, the last checkpoint).

Signals: Ctrl-C (SIGINT) exits 130, SIGTERM 143, both after cleanup (cluster shut down, MLflow run
KILLED). Inside the RL step loop the first one stops the run at the end of the current step with
a checkpoint of that step (``StopRequest``), so ``resume=<run dir>`` continues it; a second one
stops at once (the checkpoints already written are complete: they are written atomically).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rlhf.config.exits import EXIT_FAILURE, EXIT_INTERRUPT, EXIT_TERMINATED, EXIT_USER
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec

if TYPE_CHECKING:
    from rlhf.track.tracker import Console


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt (the same cleanup), exit code 143."""


def _raise_terminated(signum, frame):
    raise Terminated()


class StopRequest:
    """Stop at the end of a step instead of in the middle of it.

    ``install()`` (main thread only; elsewhere it does nothing) routes SIGINT and SIGTERM here: the
    first one only records itself (``requested``) and prints one line; the loop checks
    ``requested`` after each step, saves a checkpoint of it and raises ``exception()``. A second
    signal raises at once (a KeyboardInterrupt, or ``Terminated`` for SIGTERM): the step or the
    save in progress is abandoned. ``restore()`` puts the previous handlers back.
    """

    def __init__(self):
        self.signum: Optional[int] = None  # the first signal's
        self.requested = False  # read after every step: a plain attribute, set with ``signum``
        self._old: dict[int, Any] = {}

    def exception(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def _handler(self, signum, frame):
        if self.signum is not None:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signum, self.requested = signum, True
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        # os.write: a signal handler must not re-enter a buffered stream that may be mid-write
        os.write(2, f"\n{name}: stopping after this step, with a checkpoint of it "
                    "(Ctrl-C or SIGTERM again: stop now, without it)\n".encode())

    def install(self) -> "StopRequest":
        if _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


LOOPS = ("rl", "sft", "rm", "dpo")  # rlhf/loops/<kind>.py, each with run(spec, cluster, tracker, console, run_dir)


def write_run_dir(spec: RunSpec) -> Path:
    import yaml

    from rlhf.spec.build import config_dict, to_dict

    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    full = to_dict(spec)
    with open(run_dir / "spec.yaml", "w") as f:
        yaml.safe_dump(full, f, sort_keys=False)
    cfg = config_dict(spec)
    cfg["output_dir"] = None  # a rerun gets its own run dir
    cfg["resume"] = None  # ... and starts fresh (resume=<this dir> continues this one)
    cfg["mode"] = "run"
    with open(run_dir / "config.yaml", "w") as f:
        f.write("# The resolved config of this run. Rerun it: rlhf-run -cp <this dir> -cn config\n")
        yaml.safe_dump(cfg, f, sort_keys=False)
    return run_dir


def check_before_run(spec: RunSpec) -> int:
    """The checks a run passes before anything (its run dir included) is made: 0, or exit code 2
    having printed why (a GPU plan that does not fit, checkpoints the disk under output_dir has no
    room for, an output dir that cannot be written)."""
    try:
        _checks(spec)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_USER)
    return 0


def _checks(spec: RunSpec) -> None:
    from rlhf.preflight import check_cpu_threads, check_disk, check_fits, check_output_dir

    check_cpu_threads()
    check_fits(spec)  # nothing to check off CUDA
    check_disk(spec)
    check_output_dir(spec.run_dir)


def execute(spec: RunSpec, checked: bool = False) -> int:
    """Plan or run a built spec; the return value is the process exit code. ``checked``:
    ``check_before_run`` has passed already.

    The sweep (rlhf/sweep.py) calls this for every job too.
    """
    if spec.mode == "plan":
        from rlhf.plan.render import render_plan

        print(render_plan(spec), flush=True)
        return 0
    if not checked:
        code = check_before_run(spec)
        if code:
            return code
    if spec.hardware.accelerator == "cuda":
        from rlhf.plan.memory import estimate
        from rlhf.plan.render import warnings

        for w in warnings(spec, estimate(spec)):  # the ones that do not stop the run (idle GPUs, ...)
            print(f"warning: {w}", file=sys.stderr)
    return int(run(spec, checked=True) or 0)  # run prints a UserError itself and returns its code


def run(spec: RunSpec, checked: bool = False) -> int:
    """Run a built spec: the exit code (a UserError is printed here, exit code 2). ``checked``:
    ``check_before_run`` has passed already."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # data sets: local files, or Hub snapshots (rlhf.hub)
    kind = spec.algo.kind
    if kind not in LOOPS:
        print(f"error: algo.kind={kind!r} has no loop. Use one of: {', '.join(LOOPS)}.", file=sys.stderr)
        return EXIT_USER
    t0 = time.perf_counter()
    cluster = tracker = console = lock = None
    status = "FAILED"
    finished = False  # the run got to its end: its worker processes may be kept (rlhf.launch.pool)
    # a run dir this run makes (or finds empty) is removed again if the run is refused before the
    # tracker starts: a refused run leaves nothing behind
    fresh = not Path(spec.run_dir).is_dir() or not any(Path(spec.run_dir).iterdir())
    refused = True
    # SIGTERM gets Ctrl-C's cleanup (the default would end the process with the cluster left up)
    on_main = _main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    try:
        from rlhf.preflight import preflight, resolve_models

        if not checked:
            _checks(spec)
        from rlhf.run_lock import RunLock

        lock = RunLock(spec.run_dir)
        lock.acquire()  # before anything is written: a second run on this dir stops here, touching nothing
        run_dir = write_run_dir(spec)
        from rlhf.track import Console, Tracker

        console = Console(spec.tracking.console, spec.train.steps if kind == "rl" else None)
        console.print(f"run dir: {run_dir}")
        from rlhf.preflight import Finished, check_checkpoint

        try:  # the checkpoint to resume from verified before anything starts
            spec = check_checkpoint(spec, console)
        except Finished as e:
            refused = False
            console.print(str(e))
            return 0
        # models found (Hub ids fetched), data, reward functions and tokenizer checked, all before the
        # tracker and Ray start (also builds builtin:tiny once, before workers start)
        spec = resolve_models(spec, console)
        if any(m.repo for m in spec.models.values()):
            write_run_dir(spec)  # spec.yaml records the Hub commits the workers load
        prepared = preflight(spec, console)  # sft/rm/dpo: the tokenised data sets
        refused = False
        tracker = Tracker(spec, str(run_dir), artifacts=(str(run_dir / "spec.yaml"), str(run_dir / "config.yaml")))
        console.print(tracker.where())
        from rlhf.launch import start_cluster
        from rlhf.launch.cluster import start_phases

        from rlhf.track.worker_logs import log_dir, setup_line  # rlhf/track: the workers' output in files

        with console.status("starting the cluster: models load, engines start", str(run_dir)):
            cluster = start_cluster(spec)
        if on_main:  # ray.init sets its own SIGTERM handler (sys.exit): ours again
            signal.signal(signal.SIGTERM, _raise_terminated)
        phases = f" ({start_phases(cluster)})" if cluster.start_seconds else ""  # where the start's time went
        console.print(f"cluster up in {time.perf_counter() - t0:.1f} s{phases}: " + ", ".join(
            f"{r} ×{g.world_size}" for r, g in cluster.groups.items())
            + (f" · worker logs: {log_dir(run_dir)}/" if spec.tracking.console != "verbose" else ""))
        if setup_line(spec):
            console.print(setup_line(spec))
        for w in cluster.warnings:  # hardware.device_memory_gb against the GPU: a warning, not an error
            console.print(f"warning: {w}")
        import importlib

        loop = importlib.import_module(f"rlhf.loops.{kind}")
        extra = {"prepared": prepared} if prepared is not None else {}
        summary = loop.run(spec, cluster, tracker, console, str(run_dir), **extra)
        status = "FINISHED"
        if (run_dir / "final" / "hf").is_dir():  # every loop ends with its HF export there
            tracker.log_model_path(str(run_dir / "final" / "hf"))
        if spec.tracking.report:
            from rlhf.report import report_at_end  # rlhf/report: the run's curves, PNG + HTML, MLflow artifacts

            report_at_end(spec, run_dir, tracker, console)
        from rlhf.hub_push import push_at_end  # checkpoint.push_to_hub: final/hf to the Hub

        push_at_end(spec, run_dir, console.print)
        console.close()
        if kind == "rl":
            console.print(
                f"done in {time.perf_counter() - t0:.1f} s · mean reward first fifth "
                f"{summary.get('reward/first_fifth', float('nan')):.3f} → last fifth "
                f"{summary.get('reward/last_fifth', float('nan')):.3f}")
        else:
            console.print(f"done in {time.perf_counter() - t0:.1f} s")
        console.print(tracker.where())
        finished = True
        return 0
    except UserError as e:  # a worker's arrives as a RayTaskError that is a UserError too
        _close(console)
        print(f"error: {_user_error_inside(e) or e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        status = "KILLED"
        _close(console)
        print("interrupted: cleaning up" if not isinstance(e, Terminated) else "terminated: cleaning up",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPT
    except Exception as e:
        from rlhf import storage

        out = spec.run_dir
        write_problem = str(e) if isinstance(e, storage.StorageError) else storage.uncaught(e, out)
        if write_problem is not None:  # disk full, read-only or deleted run dir
            _close(console)
            print(f"error: {write_problem}", file=sys.stderr)
            return EXIT_FAILURE
        user = _user_error_inside(e)
        if user is not None:
            _close(console)
            print(f"error: {user}", file=sys.stderr)
            return EXIT_USER
        from rlhf.launch.cluster import ClusterStartError
        from rlhf.launch.failures import start_failure, worker_failure

        if isinstance(e, ClusterStartError):  # a worker's model load or engine start
            died = start_failure(e.__cause__, e.roster)
        else:
            died = worker_failure(e, cluster)  # a dead worker or engine, a collective timeout
        if died is not None:
            _close(console)
            from rlhf.track.worker_logs import where  # rlhf/track: the workers' own account of it

            print(f"error: {died}{where(spec)}", file=sys.stderr)
            return EXIT_FAILURE
        raise
    finally:
        # a second Ctrl-C (or SIGTERM) during cleanup must not leave actors behind
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main else None
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            _close(console)
            if cluster is not None:
                cluster.shutdown(finished=finished)
            if tracker is not None:
                tracker.finish(status)
        finally:
            if lock is not None:
                lock.release()
                if refused and fresh:
                    _remove_refused(Path(spec.run_dir))
            if on_main:
                signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
                signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)


def _remove_refused(run_dir: Path) -> None:
    """What a run refused before it started wrote into its fresh run dir (spec.yaml, config.yaml),
    and the dir while empty (the CLI then gives back the parents it made, ``rundir.release``)."""
    for name in ("spec.yaml", "config.yaml"):
        (run_dir / name).unlink(missing_ok=True)
    try:
        run_dir.rmdir()
    except OSError:  # something else was written there: kept
        pass


def _close(console: Optional[Console]) -> None:
    if console is not None:
        console.close()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _user_error_inside(e: BaseException) -> Optional[str]:
    """The message of the UserError in ``e``'s chain, else None. One raised inside a Ray worker
    arrives wrapped in a RayTaskError (its ``cause``), whose own text is the worker's traceback."""
    from rlhf.plan.oom import causes

    for c in causes(e):
        if isinstance(c, UserError) and not isinstance(getattr(c, "cause", None), BaseException):
            return str(c) or type(c).__name__
    return None
