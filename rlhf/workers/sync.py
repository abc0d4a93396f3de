"""Weight sync from the trained policy to the rollout engines, after each update.

A transport has one method, ``send() -> metrics``, called by ``rlhf.workers.schedule`` between
the update and the next generation, and ``setup_metrics``, the figures of its one-time setup (the RL
loop logs them with the first step's metrics); ``make_transport`` picks it from the spec:

* ``object_store`` (CPU, and any placement): the actor's rank 0 gathers the full state dict
  (ZeRO-3 included) and returns it as a Ray object; every rollout worker loads that same object,
  which Ray moves between processes without passing through the driver.
* ``cuda`` (GPU with vLLM engines, ``CudaTransport``): the actor's ranks send through their
  senders (``rlhf.workers.sync_cuda``): CUDA IPC for hybrid placement, an NCCL broadcast group
  for disaggregated.
"""

from __future__ import annotations

from typing import Any

from rlhf.launch.cluster import Cluster
from rlhf.rollout import registry as engines
from rlhf.spec.runspec import RunSpec
from rlhf.workers.policy import PolicyWorker
from rlhf.workers.rollout import RolloutWorker


class ObjectStoreTransport:
    def __init__(self, actor_group, rollout_group):
        self.actor = actor_group
        self.rollout = rollout_group
        self.setup_metrics: dict[str, float] = {}  # nothing to set up

    def send(self) -> dict[str, float]:
        import ray

        refs = self.actor.call_async(PolicyWorker.full_state_dict)
        state_ref = refs[0]  # rank 0 holds the full weights; the others return None
        ray.get(refs[1:])
        self.rollout.call(RolloutWorker.load_weights, state_ref)
        return {}


def make_transport(spec: RunSpec, cluster: Cluster) -> Any:
    """The weight transport for the run's device and rollout engine: on GPU, the senders when the
    engine takes weights on the device (``EngineKind.device_weights``)."""
    if spec.device == "cuda" and engines.kind(spec).device_weights:
        return CudaTransport(cluster)  # CUDA IPC (hybrid) / NCCL (disaggregated)
    return ObjectStoreTransport(cluster.actor, cluster.rollout)


class CudaTransport:
    """The transport on GPU with vLLM engines (one per rollout worker): each actor rank holds a
    sender for the run's placement (``PolicyWorker.sender``, ``rlhf.workers.sync_cuda``).

    hybrid: CUDA IPC from every actor rank to the engine on its GPU. disaggregated: one NCCL group
    of the actor's rank 0 and every vLLM worker. Moving vLLM and DeepSpeed's states out of the
    way around the send is ``rlhf.workers.schedule``'s job.
    """

    def __init__(self, cluster: Cluster, bucket_mb: int = 512) -> None:
        import ray

        self.actor = cluster.actor
        self.engines = list(cluster.rollout.workers)
        self.bucket_mb = bucket_mb
        seconds = ray.get(self.actor.call_async(PolicyWorker.gpu_sync_setup, self.engines))
        # the ranks set up at once, so the slowest is the wait (NCCL: rank 0 builds the group; IPC: none)
        self.setup_metrics = {"sync/setup_seconds": max(seconds)}

    def send(self) -> dict[str, float]:
        """Every actor rank sends (ZeRO-3 gathers are collective); rank 0's figures, as ``sync/*``."""
        stats = [s for s in self.actor.call(PolicyWorker.gpu_sync_send, self.bucket_mb) if s]
        return {f"sync/{k[5:] if k.startswith('sync_') else k}": v for k, v in stats[0].items()}
