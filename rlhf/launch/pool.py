"""Host processes kept across the runs of one driver process (``ray.reuse_workers``).

A colocated CPU run (``rlhf.launch.group.can_colocate``) starts one ``Host`` actor per worker slot,
and a fresh process pays ~5 CPU-s of library imports (torch, transformers' model code, DeepSpeed)
and ~1.2 s of Ray's worker start-up before its first step (BENCHMARKS.md §11). A driver that runs
several runs on one Ray cluster it joined (a sweep's jobs, the tests' in-process runs) would pay
that for every run. Instead, a run that finished cleanly hands its hosts back here: each leaves
the run (``Host.retire``: its worker objects dropped, torch.distributed's process group and
DeepSpeed's communication state torn down, its output and environment back to what the process
started with) and waits, idle, for the next run whose processes would be the same; that run
re-initialises it (``Host.reset``: the same construction as a new host's) instead of starting one.

Only where it cannot change a number or outlive what owns it (``usable``):

* CPU, hybrid, colocated hosts (GPU runs, per-role processes and async rollouts keep their own);
* one Ray node, and a Ray the driver joined rather than started (a driver that started Ray shuts it
  down at the end of its run, hosts included: nothing to keep them for);
* a host is reused only by a run whose processes would be identical: the same Ray session and the
  same worker environment (``rlhf.launch.group.worker_env``: PYTHONPATH, caches, thread count, ...);
* a run that failed in any way (an exception, a dead actor, Ctrl-C) kills its hosts as before; a
  host is retired only when every host of its run answers the retirement, else all are killed.

Reusable hosts run beside the run's placement group rather than inside it (Ray kills the actors
of a placement group it removes): they take no Ray CPUs (``num_cpus=0``), and the placement group
still reserves the run's worker slots, so runs sharing a cluster (a parallel sweep) are admitted
as before. Idle hosts hold no Ray resources, only their memory (a few hundred MB each); at most
``MAX_IDLE`` wait, the oldest killed first. They are Ray actors owned by this driver: they end with
it, or with ``ray.shutdown`` (``drain`` kills them first where the code shuts Ray down).

A run on a reused host gives the same metrics, bit for bit, as on a new one
(tests/launch/test_host_reuse.py): each worker seeds torch when it is built, and everything a
worker sets up per run is built again by ``reset``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlhf.spec.runspec import RunSpec

MAX_IDLE = 4  # idle hosts kept per driver process; beyond that the oldest is killed

_lock = threading.Lock()  # a parallel sweep's jobs start and end in threads of one driver
_idle: list[tuple[tuple, Any, float]] = []  # (key, Host actor handle, time it went idle), oldest first


def usable(spec: RunSpec, started_ray: bool) -> bool:
    """Whether this run's hosts may come from, and go back to, the pool."""
    from rlhf.launch.group import can_colocate

    if not spec.ray.reuse_workers or started_ray or not can_colocate(spec):
        return False
    if spec.hardware.nodes != 1:
        return False
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def key(spec: RunSpec) -> tuple:
    """What fixes a host's process: the Ray session (a node id is new with every Ray start) and
    the environment its worker process is started with."""
    import ray

    from rlhf.launch.group import worker_env

    ctx = ray.get_runtime_context()
    return (ctx.get_node_id(), ctx.get_job_id(), tuple(sorted(worker_env(spec).items())))


def take(spec: RunSpec, world_size: int, roles: dict[str, tuple[str, str]]) -> list:
    """``world_size`` Host actors for ``spec`` (rank i is element i), outside any placement group:
    idle ones of the same key re-initialised for this run, new ones for the rest."""
    import ray

    from rlhf.launch.group import Host, spawn_actor

    k = key(spec)
    with _lock:
        _idle[:] = [e for e in _idle if e[0][:2] == k[:2]]  # hosts of an earlier Ray session ended with it
        mine = [h for kk, h, _ in reversed(_idle) if kk == k][:world_size]  # the newest first
        _idle[:] = [e for e in _idle if not any(e[1] is h for h in mine)]
    alive = []
    if mine:  # a host that died while idle (killed, out of memory) is replaced, not handed to the run
        checks = [h.idle.remote() for h in mine]
        for h, ref in zip(mine, checks):
            try:
                ray.get(ref, timeout=60)
                alive.append(h)
            except Exception:  # noqa: BLE001
                _kill(h)
    hosts = [alive[rank] if rank < len(alive) else spawn_actor(Host, spec, None, 0, {"CPU": 0.0}, rank, world_size, roles)
             for rank in range(world_size)]
    try:  # the kept hosts build this run's workers now: an error there is the run's, with its own cause
        ray.get([h.reset.remote(spec, rank, world_size, roles) for rank, h in enumerate(alive)])
    except BaseException:
        for h in hosts:
            _kill(h)
        raise
    return hosts


def give_back(spec: RunSpec, hosts: list) -> bool:
    """The hosts of a run that finished cleanly, retired and kept idle; all killed (and False) if
    any of them fails to retire."""
    import ray

    try:
        ray.get([h.retire.remote() for h in hosts], timeout=120)
    except Exception:  # noqa: BLE001 - a host that cannot leave its run cleanly is not reused
        for h in hosts:
            _kill(h)
        return False
    k = key(spec)
    now = time.monotonic()
    with _lock:
        _idle.extend((k, h, now) for h in hosts)
        extra = _idle[:max(0, len(_idle) - MAX_IDLE)]
        del _idle[:len(extra)]
    for _, h, _ in extra:
        _kill(h)
    return True


def drain() -> int:
    """Kill every idle host (before this driver shuts Ray down); how many there were."""
    with _lock:
        hosts = [h for _, h, _ in _idle]
        _idle.clear()
    for h in hosts:
        _kill(h)
    return len(hosts)


def _kill(h: Any) -> None:
    import ray

    try:
        ray.kill(h, no_restart=True)
    except Exception:  # noqa: BLE001 - dead already, or Ray gone
        pass


def idle_hosts() -> list:
    """The idle Host actors, oldest first."""
    with _lock:
        return [h for _, h, _ in _idle]
