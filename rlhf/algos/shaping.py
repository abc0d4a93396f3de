"""Reward shaping: turning sequence scores into token rewards, length penalties,
score normalisation.

Conventions (shared by all of ``rlhf.algos``):

* token tensors are ``[B, T]``; ``mask`` is ``[B, T]`` with 1 for tokens generated
  by the policy (they count in the loss) and 0 for padding or tool/environment
  tokens;
* scores are ``[B]``: one scalar outcome reward per sequence.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = [
    "last_policy_token_index",
    "token_level_rewards",
    "overlong_penalty",
    "normalize_scores",
]


def last_policy_token_index(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Index of the last policy token of every row.

    ``idx[b] = max{t : mask[b, t] != 0}``; ``has[b]`` is False for rows without any
    policy token (their ``idx`` is 0 and must not be used).

    Returns ``(idx [B] long, has [B] bool)``.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    marked = torch.where(mask != 0, positions, torch.full_like(positions, -1))
    last = marked.max(dim=1).values
    has = last >= 0
    return last.clamp(min=0), has


def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards from sequence scores and an optional KL penalty.

    ``r[b, t] = scores[b] * [t == last policy token of b] - kl_coef * kl[b, t] * mask[b, t]``

    This is the "KL in reward" shaping of Ziegler et al. 2019 ("Fine-Tuning Language
    Models from Human Preferences") and Ouyang et al. 2022 (InstructGPT): the outcome
    reward is given at the final generated token and every generated token pays a
    KL penalty towards the reference policy. Rows with no policy token get all
    zeros (neither the score nor any penalty). Output dtype follows ``scores``
    promoted with ``kl`` (at least float32).
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError("scores must be [B] with B == mask.shape[0]")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    if kl is not None:
        dtype = torch.promote_types(dtype, kl.dtype)
    maskf = (mask != 0).to(dtype)
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    idx, has = last_policy_token_index(mask)
    placed = torch.where(has, scores.to(dtype), torch.zeros_like(scores, dtype=dtype))
    rewards.scatter_add_(1, idx.unsqueeze(1), placed.unsqueeze(1))
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError("kl must have the same shape as mask")
        kl_safe = torch.where(mask != 0, kl.to(dtype), torch.zeros_like(maskf))
        rewards = rewards - kl_coef * kl_safe * maskf
    return rewards


def overlong_penalty(
    lengths: torch.Tensor,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment of DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", eq. 13).

    With ``L_max = max_length`` and ``L_cache = buffer_length``::

        R(L) = 0                                  if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             = -1                                 if L > L_max

    multiplied by ``penalty_factor``. With ``buffer_length == 0`` this is a hard
    step: 0 up to ``max_length``, ``-penalty_factor`` beyond. Returns a float
    tensor ``[B]`` to be *added* to the scores.
    """
    if buffer_length < 0 or buffer_length > max_length:
        raise ValueError("need 0 <= buffer_length <= max_length")
    L = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    start = float(max_length - buffer_length)
    if buffer_length == 0:
        pen = torch.where(L > max_length, -torch.ones_like(L), torch.zeros_like(L))
    else:
        ramp = (start - L) / float(buffer_length)
        pen = torch.where(L <= start, torch.zeros_like(L), ramp)
        pen = torch.where(L > max_length, -torch.ones_like(L), pen)
    return pen * penalty_factor


def normalize_scores(
    scores: torch.Tensor,
    mode: str = "none",
    clip: Optional[float] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalise and/or clip a batch of scores ``[B]``.

    * ``mode="none"``: unchanged;
    * ``mode="batch"``: ``(s - mean(s)) / (std(s) + eps)`` over the batch, ``std`` the
      unbiased (n-1) sample standard deviation; a batch of one element becomes 0.
      (Reward normalisation as in Ziegler et al. 2019 / common PPO practice.)

    Then, if ``clip`` is given, clamp to ``[-clip, clip]``.
    """
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mode == "none":
        out = s
    elif mode == "batch":
        if s.numel() <= 1:
            out = torch.zeros_like(s)
        else:
            out = (s - s.mean()) / (s.std(unbiased=True) + eps)
    else:
        raise ValueError(f"unknown normalisation mode {mode!r} (use 'none' or 'batch')")
    if clip is not None:
        if clip <= 0:
            raise ValueError("clip must be positive")
        out = out.clamp(-clip, clip)
    return out
