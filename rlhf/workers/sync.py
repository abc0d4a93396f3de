"""Weight sync from the trained policy to the rollout engines, after each update.

One interface, ``WeightSync.sync()``; the transport is chosen from the spec:

* ``object_store`` (CPU, and any placement): the actor's rank 0 gathers the full state dict
  (ZeRO-3 included) and returns it as a Ray object; every rollout worker loads that same object,
  which Ray moves between processes without passing through the driver.
* GPU transports (CUDA IPC for hybrid, an NCCL broadcast group for disaggregated) plug in here
  as further ``Transport`` classes, selected in ``make_sync``.
"""

from __future__ import annotations

from typing import Any


class ObjectStoreTransport:
    name = "object_store"

    def __init__(self, actor_group, rollout_group):
        self.actor = actor_group
        self.rollout = rollout_group

    def sync(self) -> None:
        import ray

        refs = self.actor.call_async("full_state_dict")
        state_ref = refs[0]  # rank 0 holds the full weights; the others return None
        ray.get(refs[1:])
        ray.get([w.load_weights.remote(state_ref) for w in self.rollout.workers])


class WeightSync:
    def __init__(self, transport: Any):
        self.transport = transport

    def sync(self) -> None:
        self.transport.sync()


def make_sync(spec: Any, cluster: Any) -> WeightSync:
    return WeightSync(ObjectStoreTransport(cluster.actor, cluster.rollout))
