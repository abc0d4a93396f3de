"""Preference-learning losses (DPO family, Bradley-Terry reward model) and SFT loss."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from rlhf.algos.losses import token_logprobs

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "bradley_terry_loss", "sft_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(
    policy_chosen_logp: torch.Tensor,
    policy_rejected_logp: torch.Tensor,
    ref_chosen_logp: Optional[torch.Tensor],
    ref_rejected_logp: Optional[torch.Tensor],
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Direct preference losses on summed sequence log-probabilities ``[B]``.

    ``h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l))``
    (the reference term is 0 when ``reference_free``; the ref inputs may then be None).

    * ``"sigmoid"`` (DPO, Rafailov et al. 2023), with conservative label smoothing
      ``eps = label_smoothing`` (cDPO, Mitchell 2023):
      ``L = -(1 - eps) * log sigma(beta h) - eps * log sigma(-beta h)``;
    * ``"ipo"`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand
      Learning from Human Preferences"): ``L = (h - 1 / (2 beta))^2``;
    * ``"hinge"`` (SLiC-HF, Zhao et al. 2023): ``L = relu(1 - beta h)``.

    ``label_smoothing`` is only defined for ``"sigmoid"`` (ValueError otherwise).
    Returns ``(loss [B], metrics)`` with detached per-pair metrics
    ``chosen_reward = beta (log pi(y_w) - log pi_ref(y_w))``, ``rejected_reward``
    (same for ``y_l``), ``margin = chosen_reward - rejected_reward`` and
    ``accuracy = [chosen_reward > rejected_reward]`` (float).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if beta <= 0:
        raise ValueError("beta must be positive")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError("label_smoothing must be in [0, 0.5)")
    if label_smoothing > 0 and loss_type != "sigmoid":
        raise ValueError("label_smoothing is only supported for loss_type='sigmoid'")
    if reference_free:
        ref_c = torch.zeros_like(policy_chosen_logp)
        ref_r = torch.zeros_like(policy_rejected_logp)
    else:
        if ref_chosen_logp is None or ref_rejected_logp is None:
            raise ValueError("reference log-probs are required unless reference_free=True")
        ref_c, ref_r = ref_chosen_logp.to(policy_chosen_logp.dtype), ref_rejected_logp.to(policy_rejected_logp.dtype)
    h = (policy_chosen_logp - policy_rejected_logp) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
        if label_smoothing > 0:
            loss = loss - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        loss = torch.relu(1.0 - beta * h)
    with torch.no_grad():
        chosen_reward = beta * (policy_chosen_logp - ref_c).detach()
        rejected_reward = beta * (policy_rejected_logp - ref_r).detach()
        metrics = {
            "chosen_reward": chosen_reward,
            "rejected_reward": rejected_reward,
            "margin": chosen_reward - rejected_reward,
            "accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype),
        }
    return loss, metrics


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022;
    margin as in Llama 2, Touvron et al. 2023)::

        L = -log sigma(r_c - r_r - m)

    Returns ``(loss [B], accuracy [B])`` with ``accuracy = [r_c > r_r]`` (float,
    detached; the margin does not enter the accuracy).
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(diff)
    acc = (chosen_scores.detach() > rejected_scores.detach()).to(loss.dtype)
    return loss, acc


def sft_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Supervised next-token loss on response tokens only.

    Alignment: ``logits[:, t]`` is the prediction FOR ``labels[:, t]`` (the caller has
    already shifted, e.g. ``logits = model(x).logits[:, :-1]``, ``labels = x[:, 1:]``).
    ``loss_mask[b, t] = 1`` for tokens that are trained on (response tokens), 0 for
    prompt/padding; labels at masked positions may be anything (e.g. -100).

    ``nll_sum = -sum_{b,t} loss_mask * log softmax(logits[b, t])[labels[b, t]]``,
    ``n_tokens = sum loss_mask``. Returns ``(nll_sum, n_tokens)`` as scalar tensors so
    the caller can normalise by a global token count (see
    :func:`rlhf.algos.losses.aggregate`).
    """
    keep = loss_mask != 0
    safe_labels = torch.where(keep, labels, torch.zeros_like(labels))
    logp = token_logprobs(logits, safe_labels)
    nll = torch.where(keep, -logp, torch.zeros_like(logp))
    return nll.sum(), keep.sum().to(logp.dtype)
