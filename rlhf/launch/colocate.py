"""One process per device for hybrid placement on CPU: every role's rank i lives in host i.

On a CPU node a separate Ray actor per role buys nothing (the roles take turns on the same
cores) and costs a Python process each: importing torch + transformers + DeepSpeed is 4-8 s of
CPU per process, which on a 2-core laptop is most of a small run's wall time. So for CPU hybrid
runs the launcher starts one ``Host`` actor per device holding that device's worker objects
(policy, reference, critic, reward model, rollout engine), and gives each role a
``RoleHandle`` that looks like a Ray actor handle (``handle.method.remote(...)``). The loops,
weight sync and ``ActorGroup`` are unchanged.

Ranks of different roles on one host share the process's torch.distributed world, which is why
colocation requires every training role to have one rank per device (rank i on device i); the
launcher checks ``can_colocate`` and otherwise starts a process per role as on GPU. Async
rollouts keep separate processes: a host runs one call at a time, so generation could not
overlap training.
"""

from __future__ import annotations

import importlib

from rlhf.spec.runspec import RunSpec


def can_colocate(spec: RunSpec) -> bool:
    """CPU, hybrid, no async rollouts, every role on every device with one rank per device."""
    layout = spec.layout
    if spec.device != "cpu" or layout.mode != "hybrid" or getattr(spec.algo, "async_steps", 0):
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
    """A Ray actor holding the worker objects of several roles (one rank each) of one device."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int, roles: dict[str, tuple[str, str]]):
        self.workers = {}
        for role, (module, name) in roles.items():
            cls = getattr(importlib.import_module(module), name)
            self.workers[role] = cls(spec, role, rank, world_size)

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self.workers[role], method)(*args, **kwargs)

    def release(self, role: str) -> int:
        """Drop one role's worker (its models and engine) and return how many roles remain; the
        launcher kills the host when none do."""
        import gc

        self.workers.pop(role, None)
        gc.collect()
        return len(self.workers)


class _RemoteMethod:
    __slots__ = ("host", "role", "method")

    def __init__(self, host, role: str, method: str):
        self.host, self.role, self.method = host, role, method

    def remote(self, *args, **kwargs):
        return self.host.call.remote(self.role, self.method, *args, **kwargs)


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
