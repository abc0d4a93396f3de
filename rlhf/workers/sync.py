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

    def after_generate(self) -> dict:
        """Between generation and training (hybrid GPU placement: vLLM sleeps, DeepSpeed's states
        come back). Returns metrics for the step."""
        hook = getattr(self.transport, "after_generate", None)
        return (hook() or {}) if hook else {}

    def sync(self) -> dict:
        """Send the updated weights; returns metrics for the step (transfer time, GB/s, ...)."""
        return self.transport.sync() or {}


def make_sync(spec: Any, cluster: Any) -> WeightSync:
    if spec.device == "cuda" and spec.rollout_engine == "vllm":
        from rlhf.workers.sync_cuda import make_transport  # CUDA IPC (hybrid) / NCCL (disaggregated)

        return WeightSync(make_transport(spec, cluster))
    return WeightSync(ObjectStoreTransport(cluster.actor, cluster.rollout))
