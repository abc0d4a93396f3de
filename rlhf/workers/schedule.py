"""The hybrid memory schedule of the RL loop: what holds the device while the rollout engines
generate, what holds it while the models train, and the weight sync between the two.

One step::

    generate                  vLLM awake; the trained models' DeepSpeed states in host memory
    schedule.to_train()       vLLM sleeps; the DeepSpeed states come back
    passes, update            reference / teacher / old log-probs, values, optimizer steps
    schedule.to_generate()    caches freed, vLLM's weights wake, the weights are sent, the
                              DeepSpeed states leave, vLLM's KV cache wakes

Memory moves only in hybrid placement on GPU with vLLM (``placement.sleep_rollout``,
``placement.offload_train_state``); where the plan keeps vLLM awake (``rlhf.plan.auto``), only
the weights move. Elsewhere (CPU, disaggregated, HF rollouts) ``to_train``
does nothing and ``to_generate`` only sends the weights. Async rollouts (``algo.async_steps`` > 0)
need no case here: the build resolves both settings to false on shared GPUs (``rlhf.plan.auto``),
so vLLM stays awake while the next step generates beside the update, and the send lands after that
generation (a rollout worker runs its calls in order).

The weight sync is a transport with one method, ``send() -> metrics``, and ``setup_metrics``, the
figures of its one-time setup (the RL loop logs them with the first step's metrics);
``make_transport`` picks it from the spec:

* ``object_store`` (CPU, and any placement, ``ObjectStoreTransport``): the actor's rank 0 gathers
  the full state dict (ZeRO-3 included) and returns it as a Ray object; every rollout worker loads
  that same object, which Ray moves between processes without passing through the driver. Where
  one CPU host holds the only actor rank and the only engine (``rlhf.launch.group.Host``), the
  host hands the state dict from one to the other itself (``Host.relay``), in one call.
* ``cuda`` (GPU with vLLM engines, ``CudaTransport``): the actor's ranks send through their
  senders (``rlhf.workers.sync_cuda``): CUDA IPC for hybrid placement, an NCCL broadcast group
  for disaggregated.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlhf.launch.cluster import Cluster
from rlhf.launch.group import method_name, one_host
from rlhf.rollout import registry as engines
from rlhf.spec.runspec import RunSpec
from rlhf.workers.frozen import TeacherWorker
from rlhf.workers.policy import PolicyWorker
from rlhf.workers.rollout import RolloutWorker
from rlhf.workers.trained import TrainedWorker


# vLLM's sleep level 2 frees its weights as well as its KV cache: every step's sync rewrites them all
SLEEP_LEVEL = 2


class Schedule:
    """Moves the run's models between the generate and train phases; ``weights`` sends the
    trained policy to the rollout engines (``send() -> metrics``). Both phases return metrics."""

    def __init__(self, spec: RunSpec, cluster: Cluster, weights: Any) -> None:
        # memory moves on GPU when the engine sleeps and shares its devices with the trained roles
        hybrid = spec.device == "cuda" and engines.kind(spec).sleeps and spec.layout.rollout_beside_training
        self.weights = weights
        self.rollout = cluster.rollout
        # every trained role's states move (actor, critic); frozen models stay (bf16 weights only)
        self.trained = [g for g in (cluster.actor, cluster.critic) if g is not None]
        self.frozen = [g for g in (cluster.reference, cluster.teacher, cluster.reward_model) if g is not None]
        # on-policy distillation's teacher may wait in host memory while the engines generate
        self.teacher = cluster.teacher if hybrid and cluster.teacher is not None and spec.algo.teacher.offload else None
        self.hybrid = hybrid
        self.sleep = hybrid and spec.placement.sleep_rollout
        self.offload = hybrid and spec.placement.offload_train_state
        if self.offload:  # generation comes first: DeepSpeed's states leave the device until the update
            _on_groups(self.trained, TrainedWorker.offload_train_states)
        if self.teacher is not None:
            _on_groups([self.teacher], TeacherWorker.offload)

    def to_train(self) -> dict[str, float]:
        """After generation: vLLM sleeps, the trained models' states come back to the device."""
        out: dict[str, float] = {}
        if self.sleep:
            out.update(combine_ranks(self.rollout.call(RolloutWorker.engine_sleep, SLEEP_LEVEL)))
        if self.offload:
            out.update(_on_groups(self.trained, TrainedWorker.reload_train_states))
        if self.teacher is not None:
            out.update(_on_groups([self.teacher], TeacherWorker.reload))
        return out

    def to_generate(self) -> dict[str, float]:
        """After the update: the rollout engines get the new weights and the device back."""
        out: dict[str, float] = {}
        if self.sleep:  # the passes' cached activations go back to the device before vLLM wakes
            out.update(_on_groups(self.trained + self.frozen, PolicyWorker.release_cuda_cache))
        elif self.hybrid:  # an awake engine (async, or room for it) needs no room: the peaks, the cache kept
            out.update(_on_groups(self.trained + self.frozen, PolicyWorker.memory_peaks))
        if self.teacher is not None:  # before vLLM wakes
            out.update(_on_groups([self.teacher], TeacherWorker.offload))
        if self.sleep:
            out["time/wake_weights"] = max(self.rollout.call(RolloutWorker.engine_wake, ["weights"]))
        out.update(self.weights.send())
        if self.offload:
            out.update(_on_groups(self.trained, TrainedWorker.offload_train_states))
        if self.sleep:
            out["time/wake_kv_cache"] = max(self.rollout.call(RolloutWorker.engine_wake, ["kv_cache"]))
        return out


def make_schedule(spec: RunSpec, cluster: Cluster) -> Schedule:
    """The run's schedule; its weight transport is set up first (the GPU senders need the
    engines' handles before any state moves)."""
    return Schedule(spec, cluster, make_transport(spec, cluster))


def _on_groups(groups: Sequence[Any], method: Any) -> dict[str, float]:
    """``method`` on every rank of ``groups`` at once; the first group's figures win on shared names."""
    import ray

    refs = [g.call_async(method) for g in groups]
    results = [ray.get(r) for r in refs]
    out: dict[str, float] = {}
    for res in reversed(results):  # the actor is first: its figures are set last
        out.update(combine_ranks(res))
    return out


def combine_ranks(ds: Sequence[dict]) -> dict[str, float]:
    """The ranks' figures as one: per name, the mean over the dicts that have it; a memory peak (``memory/*_peak_*``), the
    largest: a rank runs out of memory on its own peak, not on the ranks' mean."""
    ds = [d for d in ds if d]
    if not ds:
        return {}
    keys = set().union(*ds)
    return {k: (max if "_peak_" in k else _mean)([float(d[k]) for d in ds if k in d]) for k in keys}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


# ----------------------------------------------------------------------------- the weight sync's transports


class ObjectStoreTransport:
    def __init__(self, actor_group, rollout_group):
        self.actor = actor_group
        self.rollout = rollout_group
        self.setup_metrics: dict[str, float] = {}  # nothing to set up
        # one CPU host holding the actor and the engine: the state dict goes from one to the
        # other inside that process, with no trip through Ray's object store
        self.host = one_host(actor_group.workers + rollout_group.workers) if (
            actor_group.world_size == rollout_group.world_size == 1) else None

    def send(self) -> dict[str, float]:
        import ray

        if self.host is not None:
            ray.get(self.host.relay.remote(self.actor.role, method_name(PolicyWorker.full_state_dict),
                                           self.rollout.role, method_name(RolloutWorker.load_weights)))
            return {}
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
