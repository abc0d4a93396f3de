"""``run(spec) -> exit code``: the run dir, tracking, the cluster, the loop; cleanup always.

    run_dir/spec.yaml     the full resolved spec (derived batch plan and layout included)
    run_dir/config.yaml   the user-level config: ``rlhf-run -cp <run_dir> -cn config`` reruns it
    run_dir/metrics.jsonl one line of metrics per step
    run_dir/.rlhf-run.lock while the run lives: its pid and host (rlhf.run_lock; one live run per dir)

A refused write (disk full, quota, read-only or deleted run dir; ``rlhf.storage``) is one line and
exit code 1, the newest complete checkpoint kept.

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
from typing import Any, Optional

from rlhf.config.exits import EXIT_FAILURE, EXIT_INTERRUPT, EXIT_TERMINATED, EXIT_USER
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec


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
        self.signum: Optional[int] = None
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exception(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def _handler(self, signum, frame):
        if self.signum is not None:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signum = signum
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

    run_dir = Path(spec.output_dir or "outputs/run")
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


def run(spec: RunSpec) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # data sets: local files, or Hub snapshots (rlhf.hub)
    kind = spec.algo.kind
    if kind not in LOOPS:
        print(f"error: algo.kind={kind!r} has no loop. Use one of: {', '.join(LOOPS)}.", file=sys.stderr)
        return EXIT_USER
    t0 = time.perf_counter()
    cluster = tracker = console = lock = None
    status = "FAILED"
    # SIGTERM gets Ctrl-C's cleanup (the default would end the process with the cluster left up)
    on_main = _main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    try:
        from rlhf.preflight import check_output_dir, preflight, resolve_models

        check_output_dir(spec.output_dir or "outputs/run")
        from rlhf.run_lock import RunLock

        lock = RunLock(spec.output_dir or "outputs/run")
        lock.acquire()  # before anything is written: a second run on this dir stops here, touching nothing
        run_dir = write_run_dir(spec)
        from rlhf.track import Console, Tracker

        console = Console(spec.tracking.console, spec.train.steps if kind == "rl" else None)
        console.print(f"run dir: {run_dir}")
        # models found (Hub ids fetched), data, reward functions and tokenizer checked, all before the
        # tracker and Ray start (also builds builtin:tiny once, before workers start)
        spec = resolve_models(spec, console)
        if any(m.repo for m in spec.models.values()):
            write_run_dir(spec)  # spec.yaml records the Hub commits the workers load
        prepared = preflight(spec, console)  # sft/rm/dpo: the tokenised data sets
        tracker = Tracker(spec, str(run_dir), artifacts=(str(run_dir / "spec.yaml"), str(run_dir / "config.yaml")))
        console.print(tracker.where())
        from rlhf.launch import start_cluster

        cluster = start_cluster(spec)
        if on_main:  # ray.init sets its own SIGTERM handler (sys.exit): ours again
            signal.signal(signal.SIGTERM, _raise_terminated)
        console.print(f"cluster up in {time.perf_counter() - t0:.1f} s: " + ", ".join(
            f"{r} ×{g.world_size}" for r, g in cluster.groups.items()))
        import importlib

        loop = importlib.import_module(f"rlhf.loops.{kind}")
        extra = {"prepared": prepared} if prepared is not None else {}
        summary = loop.run(spec, cluster, tracker, console, str(run_dir), **extra)
        status = "FINISHED"
        if (run_dir / "final" / "hf").is_dir():  # every loop ends with its HF export there
            tracker.log_model_path(str(run_dir / "final" / "hf"))
        console.close()
        if kind == "rl":
            console.print(
                f"done in {time.perf_counter() - t0:.1f} s · mean reward first fifth "
                f"{summary.get('reward/first_fifth', float('nan')):.3f} → last fifth "
                f"{summary.get('reward/last_fifth', float('nan')):.3f}")
        else:
            console.print(f"done in {time.perf_counter() - t0:.1f} s")
        console.print(tracker.where())
        return 0
    except UserError as e:
        _close(console)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        status = "KILLED"
        _close(console)
        print("interrupted: cleaning up" if not isinstance(e, Terminated) else "terminated: cleaning up",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPT
    except Exception as e:
        from rlhf import storage

        out = spec.output_dir or "outputs/run"
        refused = str(e) if isinstance(e, storage.StorageError) else storage.uncaught(e, out)
        if refused is not None:  # disk full, read-only or deleted run dir
            _close(console)
            print(f"error: {refused}", file=sys.stderr)
            return EXIT_FAILURE
        user = _user_error_inside(e)
        if user is not None:
            _close(console)
            print(f"error: {user}", file=sys.stderr)
            return EXIT_USER
        died = _dead_worker(e, cluster)
        if died is not None:
            _close(console)
            print(f"error: {died}", file=sys.stderr)
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
                cluster.shutdown()
            if tracker is not None:
                tracker.finish(status)
        finally:
            if lock is not None:
                lock.release()
            if on_main:
                signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
                signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)


def _close(console) -> None:
    if console is not None:
        console.close()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _dead_worker(e: BaseException, cluster) -> str | None:
    """A Ray worker process that died (killed, out of memory, crashed) -> one line naming its role
    (and its node when there are several; a lost node is named with every rank it held)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return None
    if not isinstance(e, RayActorError):
        return None
    actor_id = getattr(e, "actor_id", None)
    roles, rank = [], None  # several roles when one process held them (CPU hybrid)
    if cluster is not None and actor_id:
        for name, group in cluster.groups.items():
            for r, w in enumerate(group.workers):
                if w._actor_id.hex() == actor_id:
                    roles.append(name)
                    rank = r
    cause = str(e).strip().split("\n")[0][:300]
    if len(roles) > 1:
        who = f"the process holding the {', '.join(roles[:-1])} and {roles[-1]} workers (rank {rank})"
    else:
        who = f"the {roles[0]} worker (rank {rank})" if roles else "a worker process"
    ckpt = ""
    if cluster is not None:
        try:
            from rlhf.ckpt.manager import find_latest

            latest = find_latest(cluster.spec.output_dir or "outputs/run")
            ckpt = f" Last checkpoint: {latest.path} (step {latest.step}); continue with resume=<run dir>." if latest \
                else " No checkpoint was written yet."
        except Exception:  # noqa: BLE001
            pass
    k = _worker_node(cluster, roles[0], rank) if roles else None
    if k is not None:
        lost = _lost_node(cluster, k, actor_id)
        if lost is not None:  # Ray's cause would only say "its node has died"
            return f"{lost} was lost during the run. Cluster shut down.{ckpt}"
        who += f" on node {k}"
    gpus = _worker_gpus(cluster, roles[0], rank) if roles else None
    if gpus:
        who += f", {gpus},"
    return f"{who} died during the run ({cause}). Cluster shut down.{ckpt}"


def _worker_gpus(cluster, role: str, rank: int) -> str | None:
    """``GPU 3`` (``GPUs 4-7`` for a tensor-parallel engine), numbered within its node, on a GPU run."""
    spec = getattr(cluster, "spec", None)
    if spec is None or spec.device != "cuda":
        return None
    per_node = spec.hardware.devices_per_node
    devs = tuple(spec.layout.engines[rank]) if role == "rollout" else (spec.layout.roles[role][rank],)
    local = tuple(d % per_node for d in devs)
    return f"GPU {local[0]}" if len(local) == 1 else f"GPUs {_span(local)}"


def _worker_node(cluster, role: str, rank: int) -> int | None:
    """The plan node of a role's rank, when the run has several nodes."""
    if cluster is None or not cluster.nodes:
        return None
    from rlhf.spec.nodes import node_of, rank_devices

    return node_of(cluster.spec, rank_devices(cluster.spec)[role][rank])


def _lost_node(cluster, k: int, actor_id: str, wait_s: float = 30.0) -> str | None:
    """The subject of the error line, node K (Ray node ..., holding <its ranks>), when plan node
    ``k``, where the dead worker ran, is gone; None when the worker alone died.

    The GCS marks a node dead before the actors on it, and a worker that crashed on a live node
    is marked dead by its raylet: once the actor table says DEAD, the node table says whether
    the node went with it. The wait covers an actor whose death is not recorded yet.
    """
    from rlhf.spec.nodes import node_ranks

    spec, node_id = cluster.spec, cluster.nodes[k]
    try:
        import ray
        from ray._private import state

        deadline = time.monotonic() + wait_s
        while True:
            actor_dead = (state.actors(actor_id=actor_id) or {}).get("State") == "DEAD"
            info = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
            if not info.get("Alive", True):
                break
            if actor_dead or time.monotonic() > deadline:
                return None
            time.sleep(0.2)
    except Exception:  # noqa: BLE001  (no answer from Ray: report the worker alone)
        return None
    held = []
    for r, ranks in node_ranks(spec)[k].items():
        what = f"{spec.rollout_engine} engine" if r == "rollout" else f"{r} rank"
        held.append(f"{what}{'s' if len(ranks) > 1 else ''} {_span(ranks)}")
    held_s = held[0] if len(held) == 1 else f"{', '.join(held[:-1])} and {held[-1]}"
    return f"node {k} (Ray node {node_id[:8]} at {info.get('NodeManagerAddress', '?')}, holding {held_s})"


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _user_error_inside(e: BaseException):
    """A UserError raised inside a Ray worker arrives wrapped in a RayTaskError."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, UserError):
        return cause.args[0] if cause.args else type(cause).__name__
    if isinstance(e, UserError):
        return e
    return None
