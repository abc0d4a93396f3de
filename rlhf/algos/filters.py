"""Sample filters."""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["dynamic_sampling_filter"]


def dynamic_sampling_filter(scores: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, int]:
    """Dynamic sampling of DAPO (Yu et al. 2025, sec. 3.2): keep only groups whose
    rewards are not all equal, i.e. ``0 < |{o_i : is_equivalent(a, o_i)}| < G`` for
    binary accuracy rewards; in general ``max(s_group) != min(s_group)``.

    Such groups give zero group-relative advantage (GRPO/RLOO/Dr.GRPO) and thus no
    gradient. A group of size 1 is always "all equal" and dropped. Rows of group
    ``g`` are ``g*n .. g*n + n - 1`` (``n = group_size``).

    Returns ``(keep_mask [B] bool, n_groups_dropped)``.
    """
    if scores.dim() != 1:
        raise ValueError("scores must be [B]")
    if group_size < 1 or scores.shape[0] % group_size != 0:
        raise ValueError(f"batch size {scores.shape[0]} is not a multiple of group_size={group_size}")
    g = scores.view(-1, group_size)
    varied = g.max(dim=1).values != g.min(dim=1).values
    keep = varied.repeat_interleave(group_size)
    return keep, int((~varied).sum().item())
