"""ActorGroup: the N ranks of one role, which form one torch.distributed group, and how the driver
calls them: ``group.call(PolicyWorker.save_hf, ...)``, ``group.scatter(PolicyWorker.update, shards)``.

A rank is a Ray actor of its own, or (CPU hybrid placement) one role's worker object inside a
``Host`` actor that holds every role of its device.

Colocated hosts: on a CPU node a separate Ray actor per role buys nothing (the roles take turns on
the same cores) and costs a Python process each: importing torch + transformers + DeepSpeed is
4-8 s of CPU per process, which on a 2-core laptop is most of a small run's wall time. So for CPU
hybrid runs the launcher starts one ``Host`` actor per device holding that device's worker objects
(policy, reference, critic, reward model, rollout engine), and gives each role a ``RoleHandle``
that looks like a Ray actor handle (``handle.method.remote(...)``). The loops, weight sync and
``ActorGroup`` are unchanged.

Ranks of different roles on one host share the process's torch.distributed world, which is why
colocation requires every training role to have one rank per device (rank i on device i); the
launcher checks ``can_colocate`` and otherwise starts a process per role as on GPU. Async
rollouts keep separate processes: a host runs one call at a time, so generation could not
overlap training.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import ray

from rlhf.spec.runspec import RunSpec

REPO_ROOT = str(Path(__file__).resolve().parents[2])

# A worker method, best given by reference (``PolicyWorker.update``) so that a reader's "find
# callers" finds the call; a name still works.
Method = Union[Callable[..., Any], str]


def method_name(method: Method) -> str:
    """The name a Ray actor handle knows ``method`` by."""
    return method if isinstance(method, str) else method.__name__


def worker_env(spec: RunSpec) -> dict[str, str]:
    # Workers load the dirs the driver resolved (spec.models); they use the network only on a node
    # that lacks a Hub snapshot (rlhf.models.model_dir), and only where the user allows it.
    hub = any(m.repo for m in (getattr(spec, "models", None) or {}).values())
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH", "")] if p),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0" if hub else "1"),
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "DS_ACCELERATOR": "cpu" if spec.device == "cpu" else "cuda",
    }
    for key in ("RLHF_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "RLHF_CPU_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    if spec.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def spawn_actor(cls: type, spec: RunSpec, pg: Any, bundle: int, resources: dict[str, float], *args):
    """Start ``cls(spec, *args)`` as a Ray actor on bundle ``bundle`` of placement group ``pg``."""
    opts: dict = {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        "runtime_env": {"env_vars": worker_env(spec)},
        "name": None,
        "max_concurrency": 1,
    }
    if pg is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False)
    return ray.remote(cls).options(**opts).remote(spec, *args)


class ActorGroup:
    """The ``world_size`` ranks of one role: Ray actor handles, or ``RoleHandle``s of colocated
    hosts (below), which answer the same ``handle.method.remote(...)``.

    ``ActorGroup.spawn`` starts rank i of ``worker_cls`` on ``slots[i]`` = (placement group,
    bundle), taking ``resources`` from it (e.g. {"CPU": 0.5} or {"GPU": 0.5, "CPU": 0.1}), with
    ``args[i]`` (if given) after its role, rank and world size.
    ``start()`` then has rank 0 pick MASTER_ADDR/PORT, and every rank joins the process group and
    loads its models (``Worker.init_distributed``).
    """

    def __init__(self, role: str, workers: Sequence[Any]):
        self.role = role
        self.world_size = len(workers)
        self.workers = list(workers)

    @classmethod
    def spawn(cls, worker_cls: type, spec: RunSpec, role: str, slots: Sequence[tuple[Any, int]],
              resources: dict[str, float], args: Optional[Sequence[tuple]] = None) -> "ActorGroup":
        return cls(role, [spawn_actor(worker_cls, spec, pg, bundle, resources, role, rank, len(slots),
                                      *(args[rank] if args else ()))
                          for rank, (pg, bundle) in enumerate(slots)])

    def start(self, ranks: Optional[Sequence[int]] = None) -> list:
        """Async: join the process group and load models (``ranks``: only these; default all).
        ``ray.get`` the result to wait."""
        addr, port = ray.get(self.workers[0].address.remote())
        chosen = range(self.world_size) if ranks is None else ranks
        return [self.workers[i].init_distributed.remote(addr, port) for i in chosen]

    def call_async(self, method: Method, *args, **kwargs) -> list:
        """``method`` (e.g. ``PolicyWorker.save_hf``) on every rank; the result refs, rank order."""
        name = method_name(method)
        return [getattr(w, name).remote(*args, **kwargs) for w in self.workers]

    def call(self, method: Method, *args, **kwargs) -> list:
        return ray.get(self.call_async(method, *args, **kwargs))

    def scatter_async(self, method: Method, shards: Sequence[Any], *args, **kwargs) -> list:
        """Rank i gets ``shards[i]`` as its first argument."""
        assert len(shards) == len(self.workers)
        name = method_name(method)
        return [getattr(w, name).remote(s, *args, **kwargs) for w, s in zip(self.workers, shards)]

    def scatter(self, method: Method, shards: Sequence[Any], *args, **kwargs) -> list:
        return ray.get(self.scatter_async(method, shards, *args, **kwargs))

    def kill(self) -> None:
        """Kill this group's processes (a colocated host with every role it holds)."""
        for w in self.workers:
            try:
                ray.kill(w.host if isinstance(w, RoleHandle) else w, no_restart=True)
            except Exception:  # noqa: BLE001  (dead already)
                pass
        self.workers = []

    def release(self) -> None:
        """Free this role's workers mid-run (DPO's reference once its log-probs are computed): a
        colocated host drops only this role's objects and dies with its last role."""
        if not any(isinstance(w, RoleHandle) for w in self.workers):
            # ray.kill does not wait for the process to exit: its device memory is given back first
            ray.get([w.drop_models.remote() for w in self.workers])
            return self.kill()
        left = ray.get([w.host.release.remote(w.role) for w in self.workers])
        for w, n in zip(self.workers, left):
            if n == 0:
                ray.kill(w.host, no_restart=True)
        self.workers = []


# ----------------------------------------------------------------------------- colocated hosts (CPU hybrid)


def can_colocate(spec: RunSpec) -> bool:
    """CPU, hybrid, no async rollouts, every role on every device with one rank per device."""
    layout = spec.layout
    if spec.device != "cpu" or not layout.one_pool or getattr(spec.algo, "async_steps", 0):
        return False
    every = tuple(range(layout.total_devices))
    for role in spec.roles:
        if role == "rollout":
            if tuple(e[0] for e in layout.engines) != every or layout.rollout_tp != 1:
                return False
        elif tuple(layout.roles[role]) != every:
            return False
    return True


class Host:
    """A Ray actor holding the worker objects of several roles (one rank each) of one device.

    Kept across runs where ``rlhf.launch.pool`` allows it: ``retire`` ends its part in a finished
    run, ``reset`` builds a new run's workers in it as a new host builds them."""

    # what the workers set in the environment for a run (torch.distributed's rendezvous, threads)
    RUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "OMP_NUM_THREADS")

    def __init__(self, spec: RunSpec, rank: int, world_size: int, roles: dict[str, tuple[str, str]]):
        self._env = {k: os.environ.get(k) for k in self.RUN_ENV}  # as Ray started the process
        self.reset(spec, rank, world_size, roles)

    def reset(self, spec: RunSpec, rank: int, world_size: int, roles: dict[str, tuple[str, str]]) -> None:
        """Build this run's worker objects (a new host, or an idle one of the pool)."""
        self.workers = {}
        for role, (module, name) in roles.items():
            cls = getattr(importlib.import_module(module), name)
            self.workers[role] = cls(spec, role, rank, world_size)

    def idle(self) -> int:
        """Answers while the process lives (the pool's check before it hands the host to a run)."""
        return os.getpid()

    def retire(self) -> int:
        """Leave a finished run: drop its worker objects (models, engines, DeepSpeed engines), leave
        torch.distributed's process group (DeepSpeed's communication state with it), and put the
        process's output and the workers' environment variables back as they were when it
        started. The host is then as a new one would be before its workers are built, apart from the
        modules it has imported. Returns the process id."""
        import gc

        self.workers = {}
        gc.collect()
        leave_process_group()
        from rlhf.track.worker_logs import restore_output

        restore_output()
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return os.getpid()

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self.workers[role], method)(*args, **kwargs)

    def relay(self, src_role: str, src_method: str, dst_role: str, dst_method: str) -> None:
        """``dst_method`` of one role given what ``src_method`` of another returns, in this process:
        the value is neither serialized nor stored by Ray (the weight sync of a host holding the
        actor and the rollout engine, ``rlhf.workers.schedule.ObjectStoreTransport``)."""
        getattr(self.workers[dst_role], dst_method)(getattr(self.workers[src_role], src_method)())

    def release(self, role: str) -> int:
        """Drop one role's worker (its models and engine) and return how many roles remain; the
        launcher kills the host when none do."""
        import gc

        self.workers.pop(role, None)
        gc.collect()
        return len(self.workers)


def leave_process_group() -> None:
    """Destroy this process's torch.distributed process group, and DeepSpeed's references to it
    and its communication backend, so that the next ``init_distributed`` starts as in a new
    process."""
    import sys

    import torch.distributed as dist

    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None and ds_comm.cdb.is_initialized():
        ds_comm.destroy_process_group()  # torch's group, and deepspeed.utils.groups' references
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if ds_comm is not None:
        ds_comm.cdb = None  # deepspeed.init_distributed builds its backend again, as in a new process


class _RemoteMethod:
    __slots__ = ("host", "role", "method")

    def __init__(self, host, role: str, method: str):
        self.host, self.role, self.method = host, role, method

    def remote(self, *args, **kwargs):
        return self.host.call.remote(self.role, self.method, *args, **kwargs)


def one_host(handles: Sequence[Any]) -> Optional[Any]:
    """The ``Host`` actor holding every one of ``handles`` (``RoleHandle``s of one host), else None."""
    if not handles or not all(isinstance(h, RoleHandle) for h in handles):
        return None
    return handles[0].host if len({h._actor_id for h in handles}) == 1 else None


class RoleHandle:
    """Stands in for a Ray actor handle of one role's rank on a Host: ``h.m.remote(...)`` calls
    ``m`` on that role's worker object. ``_actor_id`` is the host's, so a dead host is reported
    under the roles it held."""

    def __init__(self, host, role: str):
        self._host = host
        self._role = role
        self._actor_id = host._actor_id

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return _RemoteMethod(self._host, self._role, method)

    @property
    def host(self):
        return self._host

    @property
    def role(self) -> str:
        return self._role
