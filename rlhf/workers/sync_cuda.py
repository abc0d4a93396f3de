"""GPU weight sync from the trainer to vLLM rollout engines.

* ``CudaIPCSender`` (hybrid placement: trainer and vLLM share each GPU): a bucket of tensors is packed
  into one CUDA buffer on the trainer's GPU, and the engines open it through a CUDA IPC handle and
  load from it in place (no copy through the host). Two buffers alternate, so the trainer gathers
  and packs bucket i+1 while vLLM loads bucket i.
* ``NcclSender`` (disaggregated placement): the trainer's rank 0 and every vLLM worker share an NCCL
  group built for the purpose (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, the
  trainer is rank 0); each bucket is one broadcast of a flat buffer.

Both read the trainer's parameters through ``WeightSource``, which walks the model bucket by bucket
and, under ZeRO-3, gathers only one bucket's shards at a time (``deepspeed.zero.GatheredParameters``,
a collective: every trainer rank must call ``send`` together; only rank 0 talks to the engines).

``send`` returns ``{"sync_seconds", "sync_bytes", "sync_gbps", "sync_buckets"}``.
The engine side is ``rlhf.workers.vllm_ext.WeightSyncExtension``, reached through the methods of
``rlhf.workers.rollout_vllm.VLLMEngine`` (``load_ipc``, ``load_nccl``, ``sync_done``,
``init_weight_group``).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Iterator, Optional, Sequence

import torch

from rlhf.workers.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    metas_to_wire,
    pack,
    plan_buckets,
    rename,
)


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
    prefixes from parameter names.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: Optional[torch.dtype] = torch.bfloat16,
        strip_prefixes: Sequence[str] = (),
    ) -> None:
        named: list[tuple[str, torch.nn.Parameter]] = []
        seen: set[int] = set()
        for name, p in module.named_parameters():
            if id(p) in seen:  # tied weights appear once
                continue
            seen.add(id(p))
            named.append((rename(name, strip_prefixes), p))
        self.params = dict(named)
        self.zero3 = any(is_zero3_param(p) for _, p in named)
        items = []
        for name, p in named:
            shape = tuple(p.ds_shape) if is_zero3_param(p) else tuple(p.shape)
            items.append((name, shape, dtype or p.dtype))
        self.buckets: list[Bucket] = plan_buckets(items, bucket_bytes)
        self.total_bytes = sum(m.nbytes for b in self.buckets for m in b.metas)
        self.max_bucket_bytes = max((b.nbytes for b in self.buckets), default=0)

    @contextlib.contextmanager
    def gathered(self, bucket: Bucket) -> Iterator[list[torch.Tensor]]:
        """Full tensors of one bucket (ZeRO-3: gathered on every rank for the duration)."""
        params = [self.params[m.name] for m in bucket.metas]
        if self.zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield [p.data for p in params]
        else:
            yield [p.data for p in params]


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
    ``{gpu uuid: handle}`` to every engine, whose workers each open the handle of their own GPU."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)

    def setup(self) -> None:  # nothing to build for IPC
        pass

    def send(self, source: WeightSource) -> dict[str, float]:
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        rank, world = _rank_world()
        dist = _dist()
        dev = torch.device("cuda", torch.cuda.current_device())
        uuid = str(torch.cuda.get_device_properties(dev.index).uuid)
        t0 = _now_synced()
        bufs = [torch.empty(source.max_bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        # reduce_tensor's arguments do not keep the buffers alive: they stay referenced in `bufs`
        handle_args = [reduce_tensor(b)[1] for b in bufs]
        pending: list[list] = [[], []]
        try:
            for i, bucket in enumerate(source.buckets):
                slot = i % 2
                if rank == 0 and pending[slot]:
                    ray.get(pending[slot])
                    pending[slot] = []
                if world > 1 and i >= 2:
                    dist.barrier()  # no rank overwrites a buffer the engines may still read
                with source.gathered(bucket) as tensors:
                    pack(bucket, tensors, bufs[slot])
                torch.cuda.current_stream(dev).synchronize()
                mine = {uuid: handle_args[slot]}
                if world > 1:
                    every: list = [None] * world
                    dist.all_gather_object(every, mine)
                    for d in every:
                        mine.update(d)
                if rank == 0:
                    wire = metas_to_wire(bucket.metas)
                    pending[slot] = [e.load_ipc.remote(mine, wire) for e in self.engines]
            if rank == 0:
                ray.get(pending[0] + pending[1])
                ray.get([e.sync_done.remote() for e in self.engines])
            if world > 1:
                dist.barrier()
        finally:
            del bufs, handle_args
            torch.cuda.ipc_collect()
        return _stats(t0, source.total_bytes, len(source.buckets))


# --------------------------------------------------------------------------- NCCL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return "127.0.0.1"


class NcclSender:
    """Disaggregated placement: trainer rank 0 broadcasts each bucket to every vLLM worker."""

    def __init__(self, engines: Sequence[Any], engine_tp: Sequence[int]) -> None:
        if len(engines) != len(engine_tp):
            raise ValueError("one tensor-parallel size per engine")
        self.engines = list(engines)
        self.engine_tp = [int(t) for t in engine_tp]
        self.comm = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_tp)

    def setup(self, master_address: Optional[str] = None, master_port: Optional[int] = None) -> float:
        """Build the group (rank 0 of the trainer only; the others return at once). Returns seconds."""
        rank, _ = _rank_world()
        if rank != 0:
            return 0.0
        import ray
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        t0 = time.perf_counter()
        addr = master_address or node_ip()
        port = int(master_port or free_port())
        refs, offset = [], 1
        for e, tp in zip(self.engines, self.engine_tp):
            refs.append(e.init_weight_group.remote(addr, port, offset, self.world_size))
            offset += tp
        pg = StatelessProcessGroup.create(host=addr, port=port, rank=0, world_size=self.world_size)
        self.comm = PyNcclCommunicator(pg, device=torch.device("cuda", torch.cuda.current_device()))
        ray.get(refs)
        return time.perf_counter() - t0

    def send(self, source: WeightSource) -> dict[str, float]:
        import ray

        rank, _ = _rank_world()
        dev = torch.device("cuda", torch.cuda.current_device())
        if rank == 0 and self.comm is None:
            raise RuntimeError("NcclSender.setup() was not called")
        t0 = _now_synced()
        stream = torch.cuda.current_stream(dev)
        buf = torch.empty(source.max_bucket_bytes, dtype=torch.uint8, device=dev) if rank == 0 else None
        pending: list = []
        for bucket in source.buckets:
            with source.gathered(bucket) as tensors:
                if rank == 0:
                    if pending:
                        ray.get(pending)  # receivers done with the previous bucket
                    stream.synchronize()  # the previous broadcast has read `buf`
                    flat = pack(bucket, tensors, buf)
                    wire = metas_to_wire(bucket.metas)
                    pending = [e.load_nccl.remote(wire, bucket.nbytes) for e in self.engines]
                    self.comm.broadcast(flat, src=0, stream=stream)
        if rank == 0:
            stream.synchronize()
            ray.get(pending)
        return _stats(t0, source.total_bytes, len(source.buckets))

    def close(self) -> None:
        if self.comm is not None and hasattr(self.comm, "destroy"):
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001
                pass
        self.comm = None


def make_sender(mode: str, engines: Sequence[Any], engine_tp: Sequence[int] = ()) -> Any:
    """The transport for a placement mode: ``hybrid`` -> CUDA IPC, ``disaggregated`` -> NCCL."""
    if mode == "hybrid":
        return CudaIPCSender(engines)
    if mode == "disaggregated":
        return NcclSender(engines, engine_tp or [1] * len(engines))
    raise ValueError(f"placement mode {mode!r}: expected hybrid or disaggregated")
