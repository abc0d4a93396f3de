"""Start (or join) Ray, reserve devices with placement groups following ``spec.layout``, and start
one ActorGroup per role.

* hybrid: ONE placement group with a bundle per device; every role's rank i sits on bundle i and
  takes a fraction of it (1 / number of roles on the device), so all roles share every device.
* disaggregated: a placement group per role over that role's own devices.

``placement(spec)`` (pure) says which bundles each rank holds and what it takes of them; a vLLM
engine of TP > 1 is handed the bundles of its GPUs for vLLM's Ray executor.

On CPU, hybrid runs put every role's rank i in ONE process (``rlhf.launch.group.Host``): the roles
take turns on the same cores anyway, and each extra process costs seconds of imports.

On CPU a "device" is a worker slot: a bundle of 1 CPU. Ray is started with at least as many
logical CPUs as slots (logical CPUs only gate scheduling; the processes share the real cores).

Several nodes (``hardware.nodes`` > 1): plan node 0 is the Ray node the driver runs on, the others
follow in address order among the nodes that hold ``devices_per_node`` devices; each bundle carries
a label selector for the node of its device (``rlhf.spec.nodes``), so the placement is the one
``--plan`` prints and a rollout engine's TP group never spans nodes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group

from rlhf.launch.group import ActorGroup, Host, RoleHandle, can_colocate, spawn_actor, worker_env
from rlhf.placement.layout import ONE_POOL_GROUP
from rlhf.rollout import registry as engines
from rlhf.spec.errors import UserError
from rlhf.spec.nodes import held_devices, node_of
from rlhf.spec.runspec import RunSpec

ROLE_CLASSES = {
    "actor": ("rlhf.workers.policy", "PolicyWorker"),
    "critic": ("rlhf.workers.critic", "CriticWorker"),
    "reference": ("rlhf.workers.frozen", "ReferenceWorker"),
    "teacher": ("rlhf.workers.frozen", "TeacherWorker"),
    "reward": ("rlhf.workers.frozen", "RewardModelWorker"),
    "rollout": ("rlhf.workers.rollout", "RolloutWorker"),
}


def _cls(role: str):
    import importlib

    mod, name = ROLE_CLASSES[role]
    return getattr(importlib.import_module(mod), name)


@dataclass
class Cluster:
    spec: RunSpec
    groups: dict[str, ActorGroup] = field(default_factory=dict)
    placement_groups: list = field(default_factory=list)
    started_ray: bool = False
    nodes: list[str] = field(default_factory=list)  # Ray node id of each plan node (several nodes only)
    warnings: list[str] = field(default_factory=list)  # found at start-up, for the driver to print once
    pooled: list = field(default_factory=list)  # Host actors from and for rlhf.launch.pool (ray.reuse_workers)
    # seconds of each start phase, in order: "Ray" (init and placement), then "models" and "engines" where
    # the engines wait for the models (engines_wait_for_models), else "models + engines" (or "models")
    start_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def actor(self) -> Optional[ActorGroup]:
        return self.groups.get("actor")

    @property
    def critic(self) -> Optional[ActorGroup]:
        return self.groups.get("critic")

    @property
    def reference(self) -> Optional[ActorGroup]:
        return self.groups.get("reference")

    @property
    def teacher(self) -> Optional[ActorGroup]:
        return self.groups.get("teacher")

    @property
    def reward_model(self) -> Optional[ActorGroup]:
        return self.groups.get("reward")

    @property
    def rollout(self) -> Optional[ActorGroup]:
        return self.groups.get("rollout")

    def shutdown(self, finished: bool = False) -> None:
        """Kill every actor and remove every placement group this cluster made (idempotent).
        ``finished``: the run ended cleanly; its hosts go back to the pool when they came from it
        (``rlhf.launch.pool``), retired, instead of being killed."""
        if finished and self.pooled:
            from rlhf.launch import pool

            hosts, self.pooled = self.pooled, []
            for g in self.groups.values():
                g.workers = []
            pool.give_back(self.spec, hosts)
        self.pooled = []
        for g in list(self.groups.values()):
            g.kill()
        self.groups.clear()
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.placement_groups.clear()
        if self.started_ray and ray.is_initialized():
            from rlhf.launch import pool

            pool.drain()
            ray.shutdown()
        self.started_ray = False


def init_ray(spec: RunSpec, min_cpu_slots: int = 0) -> bool:
    """Join ``spec.ray.address``, reuse a Ray already initialised in this process, or start one
    locally. Returns True when this call started Ray (the cluster then shuts it down).
    ``min_cpu_slots``: on CPU without ``ray.num_cpus``, a new local cluster has at least this many
    worker slots (a sweep's one cluster: room for any of its jobs' layouts)."""
    if ray.is_initialized():
        return False
    env = {"env_vars": worker_env(spec)}
    if spec.ray.address:
        ray.init(address=spec.ray.address, runtime_env=env, log_to_driver=True)
        return False
    # A new local cluster turns token authentication on by itself (RAY_AUTH_MODE unset) and logs a
    # warning saying so on every start; that logger says nothing else. Token auth stays on.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    total = spec.layout.total_devices
    cpus = spec.ray.num_cpus or os.cpu_count() or 1
    # logging_level: Ray's own INFO lines ("Started a local Ray instance") repeat what the run prints
    # address="local": a cluster of this run's own, also when another Ray cluster runs on this
    # machine (without it ray.init joins that one); ray.address=auto joins on purpose
    # _system_config: no idle workers started ahead (Ray starts some when the driver connects): the
    # run's actors start their own processes anyway, and on a 1-device CPU run the two it started sat
    # idle, ~1 s of CPU (BENCHMARKS.md, "CPU run start-up cost")
    kwargs: dict = {"address": "local", "include_dashboard": False, "runtime_env": env, "log_to_driver": True,
                    "logging_level": logging.WARNING,
                    "_system_config": {"prestart_worker_first_driver": False, "enable_worker_prestart": False}}
    if spec.device == "cpu":  # logical slots: they only gate scheduling
        kwargs["num_cpus"] = max(cpus, total, 0 if spec.ray.num_cpus else min_cpu_slots)
        kwargs["num_gpus"] = 0
    else:
        kwargs["num_cpus"] = cpus
    try:
        ray.init(**kwargs)
    except Exception as first:  # noqa: BLE001 - a raylet slow to register on a loaded machine: once more
        ray.shutdown()
        try:
            ray.init(**kwargs)
        except Exception as again:
            raise again from first  # both failures shown, the first as the cause
    return True


def _bundle(spec: RunSpec) -> dict[str, float]:
    if spec.device == "cpu":
        return {"CPU": 1.0}
    return {"GPU": 1.0, "CPU": 1.0}


def start_cluster(spec: RunSpec) -> Cluster:
    """Placement groups + actor groups for ``spec.roles``; models loaded when this returns."""
    cluster = Cluster(spec=spec)
    phase = _PhaseClock(cluster.start_seconds)
    cluster.started_ray = init_ray(spec)
    try:
        _place(spec, cluster)
        phase.ends("Ray")
        pending = []
        if cluster.rollout is not None:  # its imports beside what follows (RolloutWorker.prepare: no device)
            pending += cluster.rollout.call_async("prepare")
        # before any model loads: a GPU smaller than the plan's is refused in seconds, not after the start
        cluster.warnings += filter(None, [check_device_memory(spec, cluster)])
        for role, g in cluster.groups.items():
            if role != "rollout":
                pending += g.start()
        if cluster.rollout is not None:  # last: later waves wait for the earlier ones
            if engines_wait_for_models(spec):
                ray.get(pending)
                phase.ends("models")
            waves = start_waves(spec)
            started = cluster.rollout.start(waves[0])
            pending += started
            for wave in waves[1:]:
                ray.get(started)
                started = cluster.rollout.start(wave)
                pending += started
        ray.get(pending)
        if "models" in cluster.start_seconds:  # the engines started once the models had loaded
            phase.ends("engines")
        else:
            phase.ends("models + engines" if cluster.rollout is not None else "models")
    except BaseException as e:
        roster = Cluster(spec=spec, groups={r: ActorGroup(r, g.workers) for r, g in cluster.groups.items()},
                         nodes=list(cluster.nodes))  # who held what, once shut down
        cluster.shutdown()
        if isinstance(e, ray.exceptions.RayError) and not isinstance(e, UserError):
            raise ClusterStartError(roster) from e
        raise
    return cluster


class _PhaseClock:
    """Writes each phase's seconds since the previous one ended into ``into``."""

    def __init__(self, into: dict[str, float]):
        self.into, self.last = into, time.perf_counter()

    def ends(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name], self.last = now - self.last, now


def start_phases(cluster: Cluster) -> str:
    """The start's phases for the console's "cluster up" line: "Ray 8.1 s, models 41.2 s, engines 52.3 s"."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in cluster.start_seconds.items())


class ClusterStartError(RuntimeError):
    """A worker raised or died while the cluster started (loading its model, starting its engine):
    the error is the ``__cause__``. The cluster is shut down; ``roster`` keeps which actor held
    which role and rank, for the driver's one line (``rlhf.launch.failures.start_failure``)."""

    def __init__(self, roster: Cluster):
        super().__init__("a worker failed while the cluster started")
        self.roster = roster


def engines_wait_for_models(spec: RunSpec) -> bool:
    """Whether the rollout engines start only once the model workers have loaded: where they share
    devices (hybrid placement) and their kind sizes its memory from the device's free memory while
    it starts (``EngineKind.starts_alone_on_device``: vLLM). vLLM counts another process's growth
    during its profiling as its own and stops when the free memory grows under it ("Error in memory
    profiling"), which a model worker's release of set-up's cached blocks did at 1.5B with a
    reference (BENCHMARKS §8, twenty-seventh session)."""
    if not engines.kind(spec).starts_alone_on_device:
        return False
    return any(spec.layout.shares("rollout", role) for role in spec.layout.roles if role != "rollout")


def start_waves(spec: RunSpec) -> list[list[int]]:
    """The rollout engines in the order they start: one wave of every engine, or, when engines
    share a device and their kind sizes its memory from the device's free memory while it starts
    (``EngineKind.starts_alone_on_device``: vLLM), wave k of the k-th engine on each device, each
    wave after the one before has started."""
    n = len(spec.layout.engines)
    if spec.layout.engines_per_device == 1 or not engines.kind(spec).starts_alone_on_device:
        return [list(range(n))]
    waves: list[list[int]] = []
    seen: Counter = Counter()
    for i, devs in enumerate(spec.layout.engines):
        k = seen[devs]
        seen[devs] += 1
        if k == len(waves):
            waves.append([])
        waves[k].append(i)
    return waves


def check_device_memory(spec: RunSpec, cluster: Cluster) -> Optional[str]:
    """hardware.device_memory_gb checked against one GPU's total: a UserError when the GPU is smaller
    and the plan does not fit it (``rlhf.plan.memory.device_memory_refusal``; the caller shuts the
    cluster down), else the warning line of ``device_memory_mismatch``, or None. Asked of the first
    training or frozen model's rank 0 once its process exists, before any model loads (Ray shows
    the process its bundle's GPU only, as device 0; a vLLM engine of TP > 1 holds no GPU in its own
    process); every GPU of a run is assumed alike. None off CUDA."""
    if spec.device != "cuda":
        return None
    from rlhf.plan.memory import device_memory_mismatch, device_memory_refusal

    group = next((cluster.groups[r] for r in ROLE_CLASSES if r != "rollout" and r in cluster.groups), None)
    if group is None:
        return None
    total = ray.get(group.workers[0].device_memory_total.remote())
    refusal = device_memory_refusal(spec, total)
    if refusal:
        raise UserError(refusal)
    return device_memory_mismatch(spec, total)


def ray_nodes(spec: RunSpec) -> list[str]:
    """The Ray node id of each plan node: the driver's node first, then the others by address.

    Only nodes with a whole node's devices count (``devices_per_node`` GPUs and CPUs; on CPU,
    that many CPUs as worker slots). Too few: a UserError naming both counts, raised before any
    placement group exists.
    """
    hw = spec.hardware
    need = {"CPU": float(hw.devices_per_node)}
    if spec.device != "cpu":
        need["GPU"] = float(hw.devices_per_node)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    fit = [n for n in alive if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
    fit.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
    if len(fit) < hw.nodes:
        what = " and ".join(f"{int(v)} {k}s" for k, v in sorted(need.items(), reverse=True))
        seen = "; ".join(f"{n['NodeManagerAddress']} {n['NodeID'][:8]}: "
                         + ", ".join(f"{n['Resources'].get(k, 0.0):g} {k}" for k in sorted(need, reverse=True))
                         for n in alive)
        raise UserError(
            f"hardware={hw.name} needs {hw.nodes} nodes with {what} each, but the Ray cluster has "
            f"{len(fit)} such node{'s' if len(fit) != 1 else ''} ({seen}). Start Ray on more nodes "
            f"(docs/multinode.md), or set hardware.nodes={max(len(fit), 1)}.")
    return [n["NodeID"] for n in fit[:hw.nodes]]


def _reserve(spec: RunSpec, cluster: Cluster, devices) -> Any:
    """A placement group with one bundle per device in ``devices`` (global indices), each on its
    plan node when there are several; ready (the cluster removes it at shutdown)."""
    kwargs = {}
    if cluster.nodes:
        kwargs["bundle_label_selector"] = [{NODE_ID_LABEL_KEY: cluster.nodes[node_of(spec, d)]} for d in devices]
    pg = placement_group([_bundle(spec) for _ in devices], strategy="PACK", **kwargs)
    cluster.placement_groups.append(pg)
    ray.get(pg.ready(), timeout=120)
    return pg


HYBRID_GROUP = ONE_POOL_GROUP  # the placement group of a placement with one pool (hybrid)


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its process on the first of ``bundles`` of placement group ``group``,
    taking ``resources`` there. ``engine``: the settings the launcher gives the rank's rollout
    engine (``EngineKind.launch_settings``), empty where the spec decides them all."""

    group: str
    bundles: tuple[int, ...]
    resources: dict[str, float]
    engine: dict[str, Any] = field(default_factory=dict)


def group_devices(spec: RunSpec) -> dict[str, tuple[int, ...]]:
    """The placement groups of ``spec.layout``: one per pool of roles that share devices (hybrid:
    one over every device; disaggregated: one per role), name -> its devices, bundle i holding
    the i-th (rollout: the engines' TP groups one after another)."""
    lay = spec.layout
    if lay.one_pool:
        return {HYBRID_GROUP: tuple(range(lay.total_devices))}
    held = held_devices(spec)
    # each device once: engines that share a device (placement.rollout.engines_per_device) share its bundle
    return {lay.group_name(pool): tuple(dict.fromkeys(d for devs in held[pool[0]] for d in devs)) for pool in lay.pools}


def placement(spec: RunSpec) -> dict[str, list[Slot]]:
    """role -> the ``Slot`` of each rank (rollout: of each engine), from the spec alone (no Ray).

    The ranks on a device take an equal share of it (hybrid: every role's; two rollout engines on
    one device, ``placement.rollout.engines_per_device``, a share each). A vLLM engine of TP > 1 runs vLLM's
    Ray executor, which starts one worker per TP rank on the bundles given as ``bundle_indices``
    (``VLLM_RAY_BUNDLE_INDICES``) in the placement group of the engine's process (vLLM reads the
    current one), each worker taking ``gpu_share`` of its GPU; the engine's process holds no GPU.
    TP 1 engines run in their own process on their one device.
    """
    held = held_devices(spec)
    groups = group_devices(spec)
    sharing = Counter(d for ranks in held.values() for devs in ranks for d in devs)  # ranks per device
    kind = engines.kind(spec) if "rollout" in held else None
    out: dict[str, list[Slot]] = {}
    for role, ranks in held.items():
        name = spec.layout.group_name(spec.layout.pool_of(role))
        share = 1.0 / max(sharing[d] for devs in ranks for d in devs)
        res = {"CPU": share} if spec.device == "cpu" else {"GPU": share, "CPU": share}
        out[role] = []
        for devs in ranks:
            bundles = tuple(groups[name].index(d) for d in devs)
            settings = kind.launch_settings(spec, bundles, share) if role == "rollout" else None
            if settings is not None:  # the engine's own processes take the devices: its worker holds none
                out[role].append(Slot(name, bundles, {"GPU": 0.0, "CPU": share}, settings))
            else:
                out[role].append(Slot(name, bundles, res))
    return out


def reserve_groups(spec: RunSpec, cluster: Cluster) -> dict[str, Any]:
    """The placement groups of ``group_devices(spec)``, ready: name -> placement group."""
    if spec.hardware.nodes > 1:
        cluster.nodes = ray_nodes(spec)
    return {name: _reserve(spec, cluster, devs) for name, devs in group_devices(spec).items()}


def reserve(spec: RunSpec, cluster: Cluster) -> dict[str, list[tuple[Any, tuple[int, ...]]]]:
    """Placement groups for ``spec.layout``, ready: role -> for each rank, (placement group, the
    bundles of its devices; a rollout engine's are its TP group)."""
    pgs = reserve_groups(spec, cluster)
    return {role: [(pgs[s.group], s.bundles) for s in slots] for role, slots in placement(spec).items()}


def _place(spec: RunSpec, cluster: Cluster) -> None:
    pgs = reserve_groups(spec, cluster)
    slots = placement(spec)
    if can_colocate(spec):  # CPU hybrid: one process per device holds every role's rank there
        n = spec.layout.total_devices
        pg = pgs[HYBRID_GROUP]
        roles = {r: ROLE_CLASSES[r] for r in slots}
        from rlhf.launch import pool

        if pool.usable(spec, cluster.started_ray):  # kept across runs: beside the placement group, which reserves the slots
            hosts = cluster.pooled = pool.take(spec, n, roles)
        else:
            hosts = [spawn_actor(Host, spec, pg, d, {"CPU": 1.0}, d, n, roles) for d in range(n)]
        for role in slots:
            cluster.groups[role] = ActorGroup(role, [RoleHandle(h, role) for h in hosts])
        return
    for role, ranks in slots.items():
        settings = [(s.engine,) for s in ranks] if any(s.engine for s in ranks) else None
        cluster.groups[role] = ActorGroup.spawn(_cls(role), spec, role, [(pgs[s.group], s.bundles[0]) for s in ranks],
                                                ranks[0].resources, settings)
