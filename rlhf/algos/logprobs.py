"""Log-probabilities and entropy straight from hidden states, chunk by chunk.

For the policy's tokens only (M of them, not every position of the batch), with the LM head
``W`` and temperature ``tau``::

    z_m      = (h_m W^T) / tau                        logits of position m, computed in chunks
    logp_m   = z_m[y_m] - logsumexp(z_m)
    H_m      = logsumexp(z_m) - sum_v softmax(z_m)_v z_m,v          (entropy, same pass)

Each chunk's logits exist only while that chunk is computed: under autograd a chunk is
recomputed in the backward pass (activation checkpointing), so neither ``[M, V]`` logits nor
their float32 copies are kept — the memory of one chunk instead of the whole vocabulary-sized
tensor, and one matmul over the response tokens instead of the model's full ``[B, T, V]``
head. Gradients: ``d logp_m / d z_m = onehot(y_m) - p_m`` and
``d H_m / d z_m = -p_m (z_m - E_p[z_m])``, taken by autograd inside the chunk.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

# logits (chunk rows × vocabulary) computed at once: 2^26 float32 values are 256 MB
CHUNK_ELEMENTS = 1 << 26


def _chunk(head: Callable, h: torch.Tensor, y: torch.Tensor, tau: float, with_entropy: bool):
    z = head(h)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if tau != 1.0:
        z = z / tau
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, y.unsqueeze(1)).squeeze(1) - lse
    if not with_entropy:
        return logp, None
    p = torch.softmax(z, dim=-1)
    return logp, lse - (p * z).sum(-1)


def logprobs_from_hidden(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = False, vocab: Optional[int] = None,
                         chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [M], entropy [M] or None)`` of ``tokens [M]`` under ``head(hidden [M, H]) / temperature``
    (see the module doc). ``vocab`` sizes the chunks (default: one probe of the head on one row).
    Results are float32 (float64 if the head computes in float64). Differentiable in ``hidden``
    and the head's parameters."""
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError("hidden must be [M, H] and tokens [M]")
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    M = hidden.shape[0]
    if M == 0:
        z = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return z, (z.clone() if with_entropy else None)
    if vocab is None:
        with torch.no_grad():
            vocab = head(hidden[:1]).shape[-1]
    rows = max(1, chunk_elements // max(int(vocab), 1))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    tokens = tokens.long()
    lps, ents = [], []
    for s in range(0, M, rows):
        h, y = hidden[s:s + rows], tokens[s:s + rows]
        if grad:
            lp, ent = checkpoint(_chunk, head, h, y, float(temperature), with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, y, float(temperature), with_entropy)
        lps.append(lp)
        if with_entropy:
            ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
