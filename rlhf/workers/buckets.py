"""Weight buckets: how a model's tensors are grouped and packed into one flat buffer per bucket.

Pure torch, no CUDA, no vLLM: the GPU transports (``rlhf.workers.sync_cuda``) and the receiving side
inside vLLM (``rlhf.rollout.vllm_ext``) both use these functions, and CI tests them on CPU.

A bucket is a list of ``TensorMeta`` (name, dtype, shape, byte offset, byte count) whose tensors are
laid out back to back in one ``uint8`` buffer, each starting at a multiple of ``ALIGN`` bytes so
that a typed view of any dtype is legal. Buckets hold at most ``bucket_bytes`` (a tensor larger
than that gets a bucket of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

ALIGN = 256  # bytes; every tensor in a bucket starts at a multiple of this
DEFAULT_BUCKET_BYTES = 512 << 20

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} in a weight bucket") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket buffer
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    metas: tuple[TensorMeta, ...]
    nbytes: int  # buffer size, aligned

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]


def plan_buckets(
    items: Iterable[tuple[str, Sequence[int], torch.dtype]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[Bucket]:
    """Group ``(name, shape, dtype)`` in order into buckets of at most ``bucket_bytes``.

    Order is kept (a ZeRO-3 gather of a bucket then touches consecutive parameters). A tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Names must be unique.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[Bucket] = []
    cur: list[TensorMeta] = []
    off = 0
    seen: set[str] = set()
    for name, shape, dtype in items:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if cur and off + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(cur), _align(off)))
            cur, off = [], 0
        cur.append(TensorMeta(name, dtype_name(dtype), shape, off, nbytes))
        off = _align(off + nbytes)
    if cur:
        buckets.append(Bucket(tuple(cur), _align(off)))
    return buckets


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (in ``bucket.metas`` order) into the ``uint8`` buffer ``out``; returns the
    used slice ``out[:bucket.nbytes]``. Copies are asynchronous on CUDA (current stream)."""
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 tensor")
    if out.numel() < bucket.nbytes:
        raise ValueError(f"buffer of {out.numel()} bytes is smaller than the bucket ({bucket.nbytes})")
    if len(tensors) != len(bucket.metas):
        raise ValueError(f"{len(tensors)} tensors for a bucket of {len(bucket.metas)}")
    for meta, t in zip(bucket.metas, tensors):
        if tuple(t.shape) != meta.shape:
            raise ValueError(f"{meta.name}: shape {tuple(t.shape)} != planned {meta.shape}")
        view = out[meta.offset : meta.offset + meta.nbytes].view(dtype_of(meta.dtype)).view(meta.shape)
        view.copy_(t.detach(), non_blocking=True)
    return out[: bucket.nbytes]


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views ``(name, tensor)`` into a packed ``uint8`` buffer (no copies)."""
    if buffer.dtype != torch.uint8:
        raise ValueError("buffer must be uint8")
    for m in metas:
        if m.offset + m.nbytes > buffer.numel():
            raise ValueError(f"{m.name}: bytes {m.offset}..{m.offset + m.nbytes} outside a {buffer.numel()}-byte buffer")
        yield m.name, buffer[m.offset : m.offset + m.nbytes].view(dtype_of(m.dtype)).view(m.shape)


def metas_to_wire(metas: Sequence[TensorMeta]) -> list[tuple]:
    """Plain tuples (cheap to pickle across Ray / vLLM's RPC)."""
    return [(m.name, m.dtype, list(m.shape), m.offset, m.nbytes) for m in metas]


def metas_from_wire(rows: Sequence[Sequence]) -> list[TensorMeta]:
    return [TensorMeta(r[0], r[1], tuple(r[2]), int(r[3]), int(r[4])) for r in rows]


def rename(name: str, strip_prefixes: Sequence[str] = ()) -> str:
    """Map a trainer parameter name to the checkpoint name vLLM's ``load_weights`` expects:
    drop wrapper prefixes (``module.``, ``_orig_mod.``, and any given)."""
    changed = True
    while changed:
        changed = False
        for p in ("module.", "_orig_mod.", *strip_prefixes):
            if p and name.startswith(p):
                name = name[len(p) :]
                changed = True
    return name
