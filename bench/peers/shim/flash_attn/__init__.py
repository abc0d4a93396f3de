"""Stand-in for the ``flash-attn`` 2.x package, for the peers' side of the bench only.

Neither peer runs here without ``flash_attn`` (OpenRLHF imports ``flash_attn.bert_padding`` at
module level; both select ``attn_implementation="flash_attention_2"`` for their padding-free
micro-batches), and flash-attn ships only as source that needs a CUDA toolchain to build (none for
CUDA 13 + torch 2.11 on the registry). This package answers the same calls with PyTorch's own
FlashAttention kernels: ``torch.nn.attention.varlen.varlen_attn`` (the FA2 varlen kernel inside
torch 2.11, the one our side uses too) for the varlen entry point, and
``scaled_dot_product_attention`` (FlashAttention backend for bf16 on Hopper) for the dense one.
It is put on the path of the peers' processes only (bench/e2e_peers.py), never of ours or TRL's.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

__version__ = "2.8.3"

# Which path each call took (the bench's question: did a peer's trainer get the FA2 kernel or the
# per-sample loop?): counted per process, one line on stderr at exit.
_PATHS: dict[str, int] = {}


def _count(path: str) -> None:
    if not _PATHS:
        import atexit
        import sys

        atexit.register(lambda: print(f"flash_attn stand-in calls: {_PATHS}", file=sys.stderr, flush=True))
    _PATHS[path] = _PATHS.get(path, 0) + 1


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _window_causal(causal: bool, window_size) -> tuple[int, int]:
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    return left, right


def _varlen_reference(q, k, v, cu_q, cu_k, scale, left, right):
    """One sample at a time with SDPA and an explicit band mask: the CPU path and the check."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1)
        ki = _repeat_kv(k[ks:ke], groups, 1).transpose(0, 1)
        vi = _repeat_kv(v[ks:ke], groups, 1).transpose(0, 1)
        lq, lk = qe - qs, ke - ks
        # flash-attn aligns the last query with the last key (bottom-right) when lq != lk
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=q.device)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            keep &= cols <= rows + right
        if left >= 0:
            keep &= cols >= rows - left
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, ``cu_seqlens_* [n + 1]`` (int32) -> ``[T, Hq, D]``."""
    if dropout_p:
        raise NotImplementedError("flash_attn stand-in: dropout")
    if softcap or alibi_slopes is not None or block_table is not None or return_attn_probs:
        raise NotImplementedError("flash_attn stand-in: softcap / alibi / block_table / attention probs")
    left, right = _window_causal(causal, window_size)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and left < 0 and right in (-1, 0) \
            and (int(max_seqlen_q) == int(max_seqlen_k) or not causal):
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if "scale" in params:
            kw["scale"] = softmax_scale
        if "enable_gqa" in params:
            kw["enable_gqa"] = q.shape[1] != k.shape[1]
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
        if "is_causal" in params:
            kw["is_causal"] = right == 0
        else:
            kw["window_size"] = (-1, right)
        cu_q = cu_seqlens_q.to(torch.int32)
        cu_k = cu_seqlens_k.to(torch.int32)
        _count("varlen_kernel")
        return varlen_attn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), **kw)
    _count(f"varlen_loop[{q.device.type},{q.dtype},causal={causal},lq==lk={int(max_seqlen_q) == int(max_seqlen_k)}]")
    return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``[B, Sq, Hq, D]`` (no padding)."""
    if dropout_p or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("flash_attn stand-in: dropout / softcap / alibi / attention probs")
    left, right = _window_causal(causal, window_size)
    if left >= 0 or right > 0 or (right == 0 and q.shape[1] != k.shape[1]):
        b, sq = q.shape[:2]
        sk = k.shape[1]
        cu_q = torch.arange(0, (b + 1) * sq, sq, device=q.device, dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * sk, sk, device=q.device, dtype=torch.int32)
        _count("dense_loop")
        o = _varlen_reference(q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
                              v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, softmax_scale, left, right)
        return o.view(b, sq, *q.shape[2:])
    groups = q.shape[2] // k.shape[2]
    _count("dense_sdpa")
    o = F.scaled_dot_product_attention(q.transpose(1, 2), _repeat_kv(k, groups, 2).transpose(1, 2),
                                       _repeat_kv(v, groups, 2).transpose(1, 2), is_causal=right == 0,
                                       scale=softmax_scale)
    return o.transpose(1, 2)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("flash_attn stand-in: flash_attn_with_kvcache (no KV-cache decoding in training)")
