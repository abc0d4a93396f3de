"""Weight sync from the trained policy to the rollout engines, after each update.

A transport has one method, ``send() -> metrics``, called by ``rlhf.workers.schedule`` between
the update and the next generation; ``make_transport`` picks it from the spec:

* ``object_store`` (CPU, and any placement): the actor's rank 0 gathers the full state dict
  (ZeRO-3 included) and returns it as a Ray object; every rollout worker loads that same object,
  which Ray moves between processes without passing through the driver.
* ``cuda`` (GPU with vLLM engines, ``rlhf.workers.sync_cuda``): CUDA IPC for hybrid placement,
  an NCCL broadcast group for disaggregated.
"""

from __future__ import annotations

from typing import Any

from rlhf.spec.runspec import RunSpec
from rlhf.workers.rollout import RolloutWorker
from rlhf.workers.train import PolicyWorker


class ObjectStoreTransport:
    name = "object_store"

    def __init__(self, actor_group, rollout_group):
        self.actor = actor_group
        self.rollout = rollout_group

    def send(self) -> dict[str, float]:
        import ray

        refs = self.actor.call_async(PolicyWorker.full_state_dict)
        state_ref = refs[0]  # rank 0 holds the full weights; the others return None
        ray.get(refs[1:])
        self.rollout.call(RolloutWorker.load_weights, state_ref)
        return {}


def make_transport(spec: RunSpec, cluster: Any) -> Any:
    """The weight transport for the run's device, rollout engine and placement."""
    if spec.device == "cuda" and spec.rollout_engine == "vllm":
        from rlhf.workers.sync_cuda import CudaTransport  # CUDA IPC (hybrid) / NCCL (disaggregated)

        return CudaTransport(spec, cluster)
    return ObjectStoreTransport(cluster.actor, cluster.rollout)
