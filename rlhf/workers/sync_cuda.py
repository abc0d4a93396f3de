"""GPU weight sync from the trainer to vLLM rollout engines.

* ``CudaIPCSender`` (hybrid placement: trainer and vLLM share each GPU): a bucket of tensors is packed
  into one CUDA buffer on the trainer's GPU, and the engines open it through a CUDA IPC handle and
  load from it in place (no copy through the host). Two buffers alternate, so the trainer gathers
  and packs bucket i+1 while vLLM loads bucket i.
* ``NcclSender`` (disaggregated placement): the trainer's rank 0 and the vLLM workers share an NCCL
  group built for the purpose (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, the
  trainer is rank 0); each bucket is one broadcast of a flat buffer. NCCL refuses two ranks of one
  group on one GPU, so engines that share a GPU (``placement.rollout.engines_per_device``) are in
  different groups ("lanes", ``nccl_lanes``), and each bucket is broadcast once per lane.

Both read the trainer's parameters through ``WeightSource``, which walks the model bucket by bucket
and, under ZeRO-3, gathers only one bucket's shards at a time (``deepspeed.zero.GatheredParameters``,
a collective: every trainer rank must call ``send`` together; only rank 0 talks to the engines).

``send`` returns ``{"sync_seconds", "sync_bytes", "sync_gbps", "sync_buckets"}``.
The engine side is ``rlhf.rollout.vllm_ext.WeightSyncExtension``, reached through the methods of
``rlhf.workers.rollout.RolloutWorker`` and ``rlhf.rollout.vllm.VLLMEngine`` (``load_ipc``,
``load_nccl``, ``sync_done``, ``init_weight_group``).

The policy worker holds its sender as a member (``sender_for``: the run's placement picks it);
the driver's side is ``rlhf.workers.schedule.CudaTransport``. ``TrainStates``, held by the actor and
the critic, moves their DeepSpeed states off the GPU while vLLM generates (hybrid placement).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from rlhf.workers.base import free_port, node_ip
from rlhf.workers.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    metas_to_wire,
    pack,
    plan_buckets,
    rename,
)
from rlhf.workers.rollout import RolloutWorker

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def is_zero3_param(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


class WeightSource:
    """A trainer model's parameters in buckets, in the names vLLM's ``load_weights`` expects.

    ``module`` is the HF model (for a DeepSpeed engine pass ``engine.module``); ``dtype`` is the
    rollout engine's dtype (tensors are cast while packing); ``strip_prefixes`` removes wrapper
    prefixes from parameter names. A LoRA model (``rlhf.models.lora``) is sent as its base model:
    base names, each adapted weight merged (``W + (alpha/r)·B A``, computed per bucket from the
    gathered ``W``, ``A``, ``B``; the trained parameters are not changed).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: Optional[torch.dtype] = torch.bfloat16,
        strip_prefixes: Sequence[str] = (),
    ) -> None:
        from rlhf.models.lora import sync_entries

        entries = sync_entries(module)  # each tensor once (tied weights under their first name)
        for e in entries:
            e.name = rename(e.name, strip_prefixes)
        self.entries = {e.name: e for e in entries}
        self.params = {e.name: e.params[0] for e in entries}
        self.zero3 = any(is_zero3_param(p) for e in entries for p in e.params)
        items = []
        for e in entries:
            p = e.params[0]
            shape = tuple(p.ds_shape) if is_zero3_param(p) else tuple(p.shape)
            items.append((e.name, shape, dtype or p.dtype))
        self.buckets: list[Bucket] = plan_buckets(items, bucket_bytes)
        self.total_bytes = sum(m.nbytes for b in self.buckets for m in b.metas)
        self.max_bucket_bytes = max((b.nbytes for b in self.buckets), default=0)

    @contextlib.contextmanager
    def gathered(self, bucket: Bucket) -> Iterator[list[torch.Tensor]]:
        """Full tensors of one bucket (ZeRO-3: gathered on every rank for the duration)."""
        entries = [self.entries[m.name] for m in bucket.metas]
        if self.zero3:
            import deepspeed

            params = [p for e in entries for p in e.params]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield [_tensor_of(e) for e in entries]
        else:
            yield [_tensor_of(e) for e in entries]


@torch.no_grad()
def _tensor_of(entry: Any) -> torch.Tensor:
    return entry.tensor([p.data for p in entry.params])


def _now_synced() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _stats(t0: float, nbytes: int, nbuckets: int) -> dict[str, float]:
    dt = max(_now_synced() - t0, 1e-9)
    return {
        "sync_seconds": dt,
        "sync_bytes": float(nbytes),
        "sync_gbps": nbytes / dt / 1e9,
        "sync_buckets": float(nbuckets),
    }


# --------------------------------------------------------------------------- CUDA IPC


class CudaIPCSender:
    """Hybrid placement: every trainer rank packs each bucket on its GPU; rank 0 sends the merged
    ``{gpu uuid: handle}`` to every engine, whose workers each open the handle of their own GPU.

    ``keep_buffers``: the two bucket buffers (and the engines' mappings of them) live from one
    sync to the next, so no CUDA IPC handle is opened twice; ``close()`` frees them.
    """

    def __init__(self, engines: Sequence[Any], keep_buffers: bool = True) -> None:
        self.engines = list(engines)
        self.keep_buffers = keep_buffers
        self._bufs: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def setup(self) -> float:  # nothing to build for IPC
        return 0.0

    def _buffers(self, nbytes: int, dev: torch.device) -> bool:
        """Make sure two buffers of ``nbytes`` exist; True when they are new (engines must drop
        their mappings of the old ones)."""
        from torch.multiprocessing.reductions import reduce_tensor

        if self._bufs and self._bufs[0].numel() >= nbytes and self._bufs[0].device == dev:
            return False
        fresh = bool(self._bufs)
        self._bufs = ipc_buffers(nbytes, dev, 2)
        # reduce_tensor's arguments do not keep a buffer alive: self._bufs does
        self._handles = [reduce_tensor(b)[1] for b in self._bufs]
        return fresh

    def send(self, source: WeightSource) -> dict[str, float]:
        import ray

        rank, world = _rank_world()
        dist = _dist()
        dev = torch.device("cuda", torch.cuda.current_device())
        uuid = str(torch.cuda.get_device_properties(dev.index).uuid)
        t0 = _now_synced()
        replaced = self._buffers(source.max_bucket_bytes, dev)
        if replaced and rank == 0:  # engines still map the old buffers
            ray.get([_call(e, RolloutWorker.sync_done, True) for e in self.engines])
        pending: list[list] = [[], []]
        t_pack = t_wait = t_load = 0.0
        try:
            for i, bucket in enumerate(source.buckets):
                slot = i % 2
                if rank == 0 and pending[slot]:
                    tw = time.perf_counter()
                    t_load += sum(ray.get(pending[slot]))
                    t_wait += time.perf_counter() - tw
                    pending[slot] = []
                if world > 1 and i >= 2:
                    dist.barrier()  # no rank overwrites a buffer the engines may still read
                tp = time.perf_counter()
                with source.gathered(bucket) as tensors:
                    pack(bucket, tensors, self._bufs[slot])
                torch.cuda.current_stream(dev).synchronize()
                t_pack += time.perf_counter() - tp
                mine = {uuid: self._handles[slot]}
                if world > 1:
                    every: list = [None] * world
                    dist.all_gather_object(every, mine)
                    for d in every:
                        mine.update(d)
                if rank == 0:
                    wire = metas_to_wire(bucket.metas)
                    pending[slot] = [_call(e, RolloutWorker.load_ipc, mine, wire) for e in self.engines]
            if rank == 0:
                tw = time.perf_counter()
                t_load += sum(ray.get(pending[0] + pending[1]))
                ray.get([_call(e, RolloutWorker.sync_done, not self.keep_buffers) for e in self.engines])
                t_wait += time.perf_counter() - tw
            if world > 1:
                dist.barrier()
        finally:
            if not self.keep_buffers:
                self.close()
        out = _stats(t0, source.total_bytes, len(source.buckets))
        out.update({"sync_pack_seconds": t_pack, "sync_wait_seconds": t_wait,
                    "sync_engine_load_seconds": t_load / max(len(self.engines), 1)})
        return out

    def close(self) -> None:
        self._bufs, self._handles = [], []
        torch.cuda.ipc_collect()


# --------------------------------------------------------------------------- NCCL


def nccl_lanes(engine_devices: Sequence[Sequence[int]]) -> list[list[int]]:
    """The engines (indices) in NCCL groups with at most one engine per device: lane k holds the
    k-th engine of each device (one lane when no engines share a device)."""
    seen: dict[tuple[int, ...], int] = {}
    lanes: list[list[int]] = []
    for i, devs in enumerate(engine_devices):
        k = seen.get(tuple(devs), 0)
        seen[tuple(devs)] = k + 1
        if k == len(lanes):
            lanes.append([])
        lanes[k].append(i)
    return lanes


class NcclSender:
    """Disaggregated placement: trainer rank 0 broadcasts each bucket to every vLLM worker, once per
    lane of engines (``nccl_lanes``: no two engines of a lane on one device)."""

    def __init__(self, engines: Sequence[Any], engine_tp: Sequence[int],
                 engine_devices: Optional[Sequence[Sequence[int]]] = None) -> None:
        if len(engines) != len(engine_tp):
            raise ValueError("one tensor-parallel size per engine")
        self.engines = list(engines)
        self.engine_tp = [int(t) for t in engine_tp]
        # without devices every engine is taken to have its own
        self.lanes = nccl_lanes(engine_devices if engine_devices is not None else [(i,) for i in range(len(engines))])
        self.comms: list = []

    @property
    def comm(self) -> Any:
        """The first lane's communicator (None before ``setup``)."""
        return self.comms[0] if self.comms else None

    def lane_world_size(self, lane: Sequence[int]) -> int:
        return 1 + sum(self.engine_tp[i] for i in lane)

    @property
    def world_size(self) -> int:
        """Ranks of the first lane's group (all of them with one lane)."""
        return self.lane_world_size(self.lanes[0]) if self.lanes else 1

    def setup(self, master_address: Optional[str] = None, master_port: Optional[int] = None) -> float:
        """Build a group per lane (rank 0 of the trainer only; the others return at once). Returns seconds."""
        rank, _ = _rank_world()
        if rank != 0:
            return 0.0
        import ray
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        t0 = time.perf_counter()
        addr = master_address or node_ip()
        for k, lane in enumerate(self.lanes):
            port = int(master_port) + k if master_port else free_port()
            world = self.lane_world_size(lane)
            refs, offset = [], 1
            for i in lane:
                refs.append(_call(self.engines[i], RolloutWorker.init_weight_group, addr, port, offset, world))
                offset += self.engine_tp[i]
            pg = StatelessProcessGroup.create(host=addr, port=port, rank=0, world_size=world)
            self.comms.append(PyNcclCommunicator(pg, device=torch.device("cuda", torch.cuda.current_device())))
            ray.get(refs)
        return time.perf_counter() - t0

    def send(self, source: WeightSource) -> dict[str, float]:
        import ray

        rank, _ = _rank_world()
        dev = torch.device("cuda", torch.cuda.current_device())
        if rank == 0 and not self.comms:
            raise RuntimeError("NcclSender.setup() was not called")
        t0 = _now_synced()
        stream = torch.cuda.current_stream(dev)
        buf = torch.empty(source.max_bucket_bytes, dtype=torch.uint8, device=dev) if rank == 0 else None
        pending: list = []
        t_pack = t_wait = t_load = 0.0
        for bucket in source.buckets:
            with source.gathered(bucket) as tensors:
                if rank == 0:
                    tw = time.perf_counter()
                    if pending:
                        t_load += sum(ray.get(pending))  # receivers done with the previous bucket
                    stream.synchronize()  # the previous broadcast has read `buf`
                    t_wait += time.perf_counter() - tw
                    tp = time.perf_counter()
                    flat = pack(bucket, tensors, buf)
                    wire = metas_to_wire(bucket.metas)
                    pending = [_call(e, RolloutWorker.load_nccl, wire, bucket.nbytes) for e in self.engines]
                    for comm in self.comms:  # one lane after another, on one stream
                        comm.broadcast(flat, src=0, stream=stream)
                    t_pack += time.perf_counter() - tp
        if rank == 0:
            tw = time.perf_counter()
            stream.synchronize()
            t_load += sum(ray.get(pending))
            ray.get([_call(e, RolloutWorker.sync_done) for e in self.engines])  # drops KV computed with old weights
            t_wait += time.perf_counter() - tw
        out = _stats(t0, source.total_bytes, len(source.buckets))
        out.update({"sync_pack_seconds": t_pack, "sync_wait_seconds": t_wait,
                    "sync_engine_load_seconds": t_load / max(len(self.engines), 1)})
        return out

    def close(self) -> None:
        for comm in self.comms:
            if hasattr(comm, "destroy"):
                try:
                    comm.destroy()
                except Exception:  # noqa: BLE001
                    pass
        self.comms = []


def ipc_buffers(nbytes: int, dev: torch.device, n: int) -> list[torch.Tensor]:
    """``n`` byte buffers that another process opens by a CUDA IPC handle: plain allocator segments
    even in a process that grows its segments (``rlhf.workers.allocator``)."""
    from rlhf.workers.allocator import plain_segments

    with plain_segments():
        return [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(n)]


def make_sender(same_devices: bool, engines: Sequence[Any], engine_tp: Sequence[int] = (),
                engine_devices: Optional[Sequence[Sequence[int]]] = None) -> CudaIPCSender | NcclSender:
    """The sender to engines on the trainer's own GPUs (``same_devices``: CUDA IPC; engines that
    share a GPU each open its buffers' handles) or on others (NCCL, a group per lane)."""
    if same_devices:
        return CudaIPCSender(engines)
    return NcclSender(engines, list(engine_tp) if engine_tp else [1] * len(engines), engine_devices)


def sender_for(spec: RunSpec, engines: Sequence[Any], rank: int) -> CudaIPCSender | NcclSender:
    """Trainer rank ``rank``'s sender for the run's placement (``spec.layout``). Every rank holds
    one (ZeRO-3 gathers are collective); only rank 0 gets the engines' handles and talks to them."""
    lead = rank == 0
    tps = [len(e) for e in spec.layout.engines] or [1] * len(engines)
    devs = list(spec.layout.engines) if spec.layout.engines else None
    return make_sender(spec.layout.shares("rollout", "actor"), engines if lead else [], tps if lead else [],
                       devs if lead else None)


def _call(handle: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """``handle.method.remote(...)``: a rollout worker (``RolloutWorker``, which forwards to its
    engine) or an engine actor (``VLLMEngine``, whose methods have the same names)."""
    return getattr(handle, method.__name__).remote(*args, **kwargs)


class TrainStates:
    """A trained role's DeepSpeed states (weights, gradients, optimizer) in hybrid placement on GPU:
    they leave the GPU while vLLM generates and come back for training (``rlhf.workers.schedule``).
    The actor and the critic each hold one, over their own engine."""

    def __init__(self, engine: Any, zero_stage: int) -> None:
        self.engine = engine
        self.zero_stage = zero_stage
        self.offloaded = False

    def _include(self):
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        if self.zero_stage == 3:
            from deepspeed.ops.adam import FusedAdam

            frozen = any(not p.requires_grad for p in self.engine.module.parameters())
            inner = getattr(self.engine.optimizer, "optimizer", None)
            # DeepSpeed moves ZeRO-3 optimizer states for FusedAdam only, and its flat parameter
            # buffer covers trained parameters only: with frozen ones (LoRA) it cannot move lp_params
            if frozen:
                return [S.lp_grads, S.contiguous_grad_buffer] + (
                    [S.optim_states, S.hp_params] if isinstance(inner, FusedAdam) else [])
            if not isinstance(inner, FusedAdam):
                return [S.lp_params, S.lp_grads, S.contiguous_grad_buffer]
        return None  # everything

    def offload(self) -> dict[str, float]:
        """Move parameters, gradients and optimizer states to host memory. (The training phase's
        peak is reported by the worker's ``release_cuda_cache``, which the schedule calls first.)"""
        t0 = time.perf_counter()
        out = {}
        if self.zero_stage >= 1 and not self.offloaded:
            self.engine.offload_states(include=self._include())
            self.offloaded = True
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["time/offload_train"] = time.perf_counter() - t0
        return out

    def reload(self) -> dict[str, float]:
        """Bring the states offloaded by ``offload`` back to the GPU."""
        t0 = time.perf_counter()
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return {"time/reload_train": time.perf_counter() - t0}
