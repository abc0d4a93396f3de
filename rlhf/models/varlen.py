"""Attention over packed sequences (``rlhf.data.packing``) for Hugging Face models.

A packed row holds several samples end to end; each token may attend only to the earlier tokens
of its own sample. ``use_varlen(model)`` makes the model attend with ``rlhf_varlen``, which looks
at each call: called with ``cu_seq_lens_q/k`` and ``max_length_q/k`` (keyword arguments that
transformers forwards from the model's call to every attention layer), it runs packed attention:

* on CUDA: PyTorch's FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``,
  forward and backward, no extra package to build for the GPU image);
* elsewhere (CPU), or where that kernel is missing: the samples scattered into right-padded rows
  for one causal SDPA call and gathered back — the same result, at the padded cost.

Any other call (a padded batch with an attention mask: the supervised loops, generation) goes to
transformers' own SDPA attention with its usual mask. The implementation stays set for the
model's life, so gradient checkpointing, which reruns layers during the backward pass, reruns
them the same way. For a packed call no mask is built (an L × L block-diagonal mask would cost
O(L²) memory): the attention keeps to the samples by ``cu_seq_lens``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

NAME = "rlhf_varlen"
_registered = False


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, H_kv, D] -> [T, H_kv * groups, D] (each kv head serves ``groups`` query heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                            scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention within each packed sample. ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``,
    ``cu [n + 1]`` sample boundaries. Returns ``[T, Hq, D]``:
    ``out_t = softmax(q_t·K_s^T · scale)·V_s`` over the keys ``s`` of t's sample with ``s ≤ t``."""
    groups = q.shape[1] // k.shape[1]
    kernel = _varlen_kernel() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if kernel is not None:
        params = inspect.signature(kernel).parameters
        kw: dict[str, Any] = {"scale": scale} if "scale" in params else {}
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        if "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)  # no key after the query: causal
        cu = cu.to(device=q.device, dtype=torch.int32)
        return kernel(q, k, v, cu, cu, max_len, max_len, **kw)
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    # one batched call: each sample right-padded to max_len in its own row; with a causal mask a
    # real query never sees the padding that follows its sample, so the result is exact
    n, L = len(cu) - 1, q.shape[0]
    lengths = (cu[1:] - cu[:-1]).to(device=q.device, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(n, device=q.device), lengths, output_size=L)  # size given: no sync
    col = torch.arange(L, device=q.device) - cu.to(q.device).long()[row]

    def padded(x):
        out = x.new_zeros(n, max_len, *x.shape[1:])
        out[row, col] = x
        return out.transpose(1, 2)  # [n, H, max_len, D]

    o = torch.nn.functional.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale)
    return o.transpose(1, 2)[row, col]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: ``query [1, Hq, L, D]``, ``key/value
    [1, Hkv, L, D]``; returns ``([1, L, Hq, D], None)``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # not packed: transformers' SDPA attention, mask and all
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise RuntimeError("rlhf_varlen attention takes one packed row")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D]
    out = varlen_causal_attention(q, k, v, cu, int(kwargs.get("max_length_q") or q.shape[0]), scaling)
    return out.unsqueeze(0), None


def _mask(**kwargs):
    """Padded calls get SDPA's mask; a call without a mask gets none. (Packed calls bring an empty 4D
    mask, ``no_mask``, which transformers passes through without asking for one.)"""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    _registered = True


def use_varlen(model) -> None:
    """Make ``model`` (and its sub-models: the setter recurses into sub-configs) attend with
    ``rlhf_varlen`` from now on."""
    register()
    model.config._attn_implementation = NAME


def packed_kwargs(packed: dict, device) -> dict:
    """The model-call arguments of a packed micro-batch (``rlhf.data.packing.pack``)."""
    # non_blocking: a blocking copy from host memory first waits for everything queued on the device
    cu = packed["cu_seqlens"].to(device=device, dtype=torch.int32, non_blocking=True)
    n = int(packed["max_len"])
    return {"input_ids": packed["input_ids"].to(device, non_blocking=True),
            "position_ids": packed["position_ids"].to(device, non_blocking=True),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n, "use_cache": False,
            "attention_mask": no_mask(device)}


def no_mask(device) -> torch.Tensor:
    """An empty 4D tensor as a packed call's attention mask. Why: given no mask, transformers looks
    for packed sequences in the position ids (``find_packed_sequence_indices``), which reads a value
    back from the device, a host sync in every forward; a 4D mask counts as prepared and is passed
    through untouched. ``rlhf_varlen`` masks with ``cu_seq_lens`` and ignores it."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)
