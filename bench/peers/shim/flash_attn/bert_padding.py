"""``flash_attn.bert_padding``'s helpers (unpad / pad by an attention mask), in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (re-exported: OpenRLHF imports it from here)


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor[indices]`` along the first axis."""
    return tensor[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """``[B, S, ...]`` + mask ``[B, S]`` -> (real tokens ``[T, ...]``, their flat indices, cu_seqlens int32,
    longest sequence, per-row counts of the used tokens)."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max().item()), used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad_input``: ``[T, ...]`` back to ``[batch, seqlen, ...]`` with zeros."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])
