"""Start (or join) Ray, reserve devices with placement groups following ``spec.layout``, and start
one ActorGroup per role.

* hybrid: ONE placement group with a bundle per device; every role's rank i sits on bundle i and
  takes a fraction of it (1 / number of roles on the device), so all roles share every device.
* disaggregated: a placement group per role over that role's own devices.

On CPU, hybrid runs put every role's rank i in ONE process (``rlhf.launch.colocate``): the roles
take turns on the same cores anyway, and each extra process costs seconds of imports.

On CPU a "device" is a worker slot: a bundle of 1 CPU. Ray is started with at least as many
logical CPUs as slots (logical CPUs only gate scheduling; the processes share the real cores).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rlhf.launch.colocate import Host, RoleHandle, can_colocate
from rlhf.launch.group import ActorGroup, spawn_actor, worker_env

ROLE_CLASSES = {
    "actor": ("rlhf.workers.train", "PolicyWorker"),
    "critic": ("rlhf.workers.train", "CriticWorker"),
    "reference": ("rlhf.workers.train", "ReferenceWorker"),
    "reward": ("rlhf.workers.train", "RewardModelWorker"),
    "rollout": ("rlhf.workers.rollout", "RolloutWorker"),
}


def _cls(role: str):
    import importlib

    mod, name = ROLE_CLASSES[role]
    return getattr(importlib.import_module(mod), name)


@dataclass
class Cluster:
    spec: Any
    groups: dict[str, ActorGroup] = field(default_factory=dict)
    placement_groups: list = field(default_factory=list)
    started_ray: bool = False

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
    def reward_model(self) -> Optional[ActorGroup]:
        return self.groups.get("reward")

    @property
    def rollout(self) -> Optional[ActorGroup]:
        return self.groups.get("rollout")

    def shutdown(self) -> None:
        """Kill every actor and remove every placement group this cluster made (idempotent)."""
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
            ray.shutdown()
        self.started_ray = False


def init_ray(spec: Any) -> bool:
    """Join ``spec.ray.address``, reuse a Ray already initialised in this process, or start one
    locally. Returns True when this call started Ray (the cluster then shuts it down)."""
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
    kwargs: dict = {"address": "local", "include_dashboard": False, "runtime_env": env, "log_to_driver": True,
                    "logging_level": logging.WARNING}
    if spec.device == "cpu":
        kwargs["num_cpus"] = max(cpus, total)
        kwargs["num_gpus"] = 0
    else:
        kwargs["num_cpus"] = cpus
    ray.init(**kwargs)
    return True


def _bundle(spec: Any) -> dict[str, float]:
    if spec.device == "cpu":
        return {"CPU": 1.0}
    return {"GPU": 1.0, "CPU": 1.0}


def start_cluster(spec: Any) -> Cluster:
    """Placement groups + actor groups for ``spec.roles``; models loaded when this returns."""
    cluster = Cluster(spec=spec)
    cluster.started_ray = init_ray(spec)
    try:
        _place(spec, cluster)
        pending = []
        for g in cluster.groups.values():
            pending += g.start()
        ray.get(pending)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _role_devices(spec: Any) -> dict[str, tuple[int, ...]]:
    """role -> devices of its ranks (rollout: the first device of each engine)."""
    out = {r: tuple(spec.layout.roles[r]) for r in spec.roles if r != "rollout"}
    if "rollout" in spec.roles:
        out["rollout"] = tuple(e[0] for e in spec.layout.engines)
    return out


def _reserve(spec: Any, cluster: Cluster, n: int):
    """A placement group of ``n`` device bundles, ready (the cluster removes it at shutdown)."""
    pg = placement_group([_bundle(spec) for _ in range(n)], strategy="PACK")
    cluster.placement_groups.append(pg)
    ray.get(pg.ready(), timeout=120)
    return pg


def _place(spec: Any, cluster: Cluster) -> None:
    devices = _role_devices(spec)
    unit = "CPU" if spec.device == "cpu" else "GPU"
    if spec.layout.mode == "hybrid":
        n = spec.layout.total_devices
        pg = _reserve(spec, cluster, n)
        if can_colocate(spec):  # CPU: one process per device holds every role's rank there
            hosts = [spawn_actor(Host, spec, pg, d, {"CPU": 1.0}, d, n, {r: ROLE_CLASSES[r] for r in devices})
                     for d in range(n)]
            for role in devices:
                cluster.groups[role] = ActorGroup(role, [RoleHandle(h, role) for h in hosts])
            return
        sharing = {d: sum(1 for r in devices if d in devices[r]) for d in range(n)}
        for role, devs in devices.items():
            share = 1.0 / max(sharing[d] for d in devs)
            res = {unit: share} if unit == "CPU" else {"GPU": share, "CPU": share}
            cluster.groups[role] = ActorGroup.spawn(_cls(role), spec, role, [(pg, d) for d in devs], res)
    else:
        for role, devs in devices.items():
            # rollout engines take TP-many devices each; one bundle per device of the role
            n = len(spec.layout.roles[role]) if role != "rollout" else sum(len(e) for e in spec.layout.engines)
            pg = _reserve(spec, cluster, n)
            step = 1 if role != "rollout" else spec.layout.rollout_tp
            res = {unit: 1.0} if unit == "CPU" else {"GPU": 1.0, "CPU": 1.0}
            cluster.groups[role] = ActorGroup.spawn(_cls(role), spec, role, [(pg, i * step) for i in range(len(devs))], res)
