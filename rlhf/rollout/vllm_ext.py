"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for weight sync.

vLLM mixes this class into its GPU worker, so ``self`` is the worker: ``self.model_runner.model`` is
the model and ``self.device`` its CUDA device. The rollout engine (``rlhf.rollout.vllm``)
calls these through ``LLM.collective_rpc("rlhf_...")``, so with tensor parallelism every TP rank runs
them. Nothing here imports vLLM at module level: the module must import on machines without it.

Receiving:

* CUDA IPC (hybrid placement, trainer and vLLM on the same GPU): the trainer packs a bucket into one
  CUDA buffer and sends ``{gpu uuid: torch IPC handle}``; each worker opens the handle for its own
  GPU, takes zero-copy views of the tensors and hands them to ``model.load_weights``.
* NCCL (disaggregated): the trainer's rank 0 and every vLLM worker join a group made for the purpose
  (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``; the trainer is rank 0); each bucket is
  one broadcast of a flat ``uint8`` buffer.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlhf.workers.buckets import metas_from_wire, unpack


class WeightSyncExtension:
    # ------------------------------------------------------------------ helpers

    def _rlhf_model(self) -> torch.nn.Module:
        # the worker's get_model() unwraps CUDA-graph wrappers
        get = getattr(self, "get_model", None)
        if callable(get):
            return get()
        return self.model_runner.model  # type: ignore[attr-defined]

    def _rlhf_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device):
            return dev
        return torch.device("cuda", torch.cuda.current_device())

    def _rlhf_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        with torch.no_grad():
            self._rlhf_model().load_weights(weights=weights)
        return len(weights)

    def rlhf_load_tensors(self, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load full tensors by checkpoint name (moved to this worker's GPU first)."""
        dev = self._rlhf_device()
        n = self._rlhf_load([(name, t.to(dev, non_blocking=True)) for name, t in weights])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return n

    # ------------------------------------------------------------------ CUDA IPC

    def rlhf_load_ipc(self, handles: dict[str, Sequence[Any]], metas: Sequence[Sequence]) -> float:
        """Load one bucket from a CUDA IPC buffer. ``handles`` maps GPU uuid -> the arguments of
        ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` for the buffer on that GPU.
        Returns the seconds spent (opening the handle, ``load_weights``, synchronising)."""
        import time

        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        t0 = time.perf_counter()
        dev = self._rlhf_device()
        uuid = str(torch.cuda.get_device_properties(dev.index).uuid)
        if uuid not in handles:
            raise RuntimeError(f"no IPC handle for this worker's GPU {uuid}; got {list(handles)}")
        args = list(handles[uuid])
        args[6] = dev.index  # the sender's device index means nothing in this process
        cache = self.__dict__.setdefault("_rlhf_ipc_buffers", {})
        # (allocation handle, offset of the storage in it, offset of the tensor in the storage)
        key = (bytes(args[7]) if isinstance(args[7], (bytes, bytearray)) else repr(args[7]), args[9], args[3])
        buf = cache.get(key)
        if buf is None:
            buf = rebuild_cuda_tensor(*args)
            cache[key] = buf  # each sender buffer is opened once, kept until released
        self._rlhf_load(list(unpack(buf, metas_from_wire(metas))))
        torch.cuda.current_stream(dev).synchronize()  # the sender may reuse the buffer once we return
        return time.perf_counter() - t0

    def rlhf_sync_done(self, release: bool = True) -> None:
        """End of a sync. ``release``: drop the opened IPC buffers (the trainer frees or replaces
        them next); otherwise keep them mapped for the next sync."""
        if release:
            self.__dict__.pop("_rlhf_ipc_buffers", None)
        torch.cuda.synchronize(self._rlhf_device())

    # ------------------------------------------------------------------ NCCL

    def rlhf_init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> int:
        """Join the trainer<->vLLM NCCL group as rank ``rank_offset + tp_rank``. Must be called on
        all vLLM workers while the trainer joins as rank 0 (the call blocks until all have joined)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        rank = rank_offset + int(getattr(pc, "rank", 0))
        pg = StatelessProcessGroup.create(host=master_address, port=int(master_port), rank=rank, world_size=world_size)
        self._rlhf_comm = PyNcclCommunicator(pg, device=self._rlhf_device())
        return rank

    def rlhf_load_nccl(self, metas: Sequence[Sequence], nbytes: int) -> float:
        """Receive one bucket by broadcast from rank 0 and load it; returns the seconds spent."""
        import time

        t0 = time.perf_counter()
        comm = getattr(self, "_rlhf_comm", None)
        if comm is None:
            raise RuntimeError("rlhf_init_weight_group was not called on this worker")
        dev = self._rlhf_device()
        buf = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
        stream = torch.cuda.current_stream(dev)
        comm.broadcast(buf, src=0, stream=stream)
        self._rlhf_load(list(unpack(buf, metas_from_wire(metas))))
        stream.synchronize()
        return time.perf_counter() - t0

    def rlhf_close_weight_group(self) -> None:
        comm = self.__dict__.pop("_rlhf_comm", None)
        if comm is not None and hasattr(comm, "destroy"):
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

    # ------------------------------------------------------------------ checks

    def rlhf_weight_digest(self) -> dict[str, float]:
        """float64 sum and sum of squares over all parameters (a cheap check that a sync landed:
        vLLM fuses q/k/v and gate/up, but sums over the whole model do not depend on layout)."""
        s = torch.zeros((), dtype=torch.float64, device=self._rlhf_device())
        sq = torch.zeros_like(s)
        n = 0
        seen: set[int] = set()
        for _, p in self._rlhf_model().named_parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            x = p.detach().to(torch.float64)
            s += x.sum()
            sq += (x * x).sum()
            n += p.numel()
        return {"sum": float(s), "sumsq": float(sq), "numel": n}
