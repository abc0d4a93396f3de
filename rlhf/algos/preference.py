"""Preference-learning losses (DPO family; KTO, ORPO, SimPO; Bradley-Terry reward model) and SFT loss."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from rlhf.algos.losses import token_logprobs
from rlhf.algos.registry import PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES

__all__ = ["DPO_LOSS_TYPES", "PREFERENCE_METHODS", "REFERENCE_FREE_METHODS", "dpo_loss", "kto_loss",
           "kto_reference_point", "orpo_loss", "pair_preference_loss", "simpo_loss", "log_odds", "bradley_terry_loss", "sft_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
PREFERENCE_METHODS = PREFERENCE_LOSSES  # algo.loss_type of the preference trainer
REFERENCE_FREE_METHODS = REFERENCE_FREE_LOSSES  # need no reference model


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


def kto_reference_point(kl_policy_logp: torch.Tensor, kl_ref_logp: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z0 = max(0, mean_j (log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))`` over
    mismatched pairs ``(x_j, y'_j)`` (another example's completion): a batch estimate of
    KL(pi || pi_ref), detached (Ethayarajh et al. 2024, section 4.1). A 0-d tensor."""
    return (kl_policy_logp.detach() - kl_ref_logp.to(kl_policy_logp.dtype)).mean().clamp(min=0.0)


def kto_loss(
    policy_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8)
    on unpaired completions: with ``r = log pi(y|x) - log pi_ref(y|x)`` (summed log-probs ``[B]``)
    and the reference point ``z0`` (:func:`kto_reference_point`)::

        v(x, y) = lambda_D * sigmoid(beta (r - z0))   if y is desirable
                = lambda_U * sigmoid(beta (z0 - r))   otherwise
        L       = lambda_y - v(x, y)

    (``lambda_D = desirable_weight``, ``lambda_U = undesirable_weight``; the paper advises
    ``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]). Returns ``(loss [B], metrics)``: detached
    ``reward = beta r`` and ``accuracy = [sign(r - z0) agrees with the label]`` per example."""
    if beta <= 0:
        raise ValueError("beta must be positive")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError("desirable_weight and undesirable_weight must be >= 0")
    r = policy_logp - ref_logp.to(policy_logp.dtype)
    z = z0.to(r.dtype).detach()
    d = desirable.to(torch.bool)
    loss = torch.where(d, desirable_weight * (1.0 - torch.sigmoid(beta * (r - z))),
                       undesirable_weight * (1.0 - torch.sigmoid(beta * (z - r))))
    with torch.no_grad():
        metrics = {"reward": beta * r.detach(), "accuracy": ((r.detach() > z) == d).to(r.dtype)}
    return loss, metrics


def log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``p = exp(avg_logp)``, ``avg_logp < 0``: ``a - log(1 - e^a)``, the
    second term as ``log(-expm1(a))`` near 0 and ``log1p(-e^a)`` below ``-log 2`` (accurate in both).
    ``a`` is capped at ``-1e-6`` (p = 1 has infinite odds)."""
    a = avg_logp.clamp(max=-1e-6)
    log1mexp = torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    return a - log1mexp


def orpo_loss(
    chosen_avg_logp: torch.Tensor,
    rejected_avg_logp: torch.Tensor,
    *,
    lam: float = 0.1,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
    eqs. 6-7), reference-free, on length-normalised log-probs ``a = (1/|y|) log pi(y|x)`` ``[B]``::

        odds(y) = P / (1 - P),  P = exp(a)
        L_OR    = -log sigmoid(log odds(y_w) - log odds(y_l))
        L       = -a_w + lam * L_OR

    (``-a_w``: the chosen response's mean token NLL, the SFT term, per pair as in the paper's
    expectation over pairs; TRL averages it over the batch's chosen tokens instead). Returns
    ``(loss [B], metrics)``: detached ``chosen_reward = lam a_w``, ``rejected_reward``, ``margin``,
    ``log_odds_ratio`` and ``accuracy = [log odds(y_w) > log odds(y_l)]``; ``nll`` the SFT term."""
    if lam < 0:
        raise ValueError("lam must be >= 0")
    lor = log_odds(chosen_avg_logp) - log_odds(rejected_avg_logp)
    nll = -chosen_avg_logp
    loss = nll - lam * F.logsigmoid(lor)
    with torch.no_grad():
        cr, rr = lam * chosen_avg_logp.detach(), lam * rejected_avg_logp.detach()
        metrics = {"chosen_reward": cr, "rejected_reward": rr, "margin": cr - rr, "log_odds_ratio": lor.detach(),
                   "accuracy": (lor.detach() > 0).to(lor.dtype), "nll": nll.detach()}
    return loss, metrics


def simpo_loss(
    chosen_avg_logp: torch.Tensor,
    rejected_avg_logp: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6), reference-free, on length-normalised log-probs ``a = (1/|y|) log pi(y|x)``::

        L = -log sigmoid(beta a_w - beta a_l - gamma)

    (the implicit reward ``beta a``, a target margin ``gamma``). Returns ``(loss [B], metrics)``
    with detached ``chosen_reward = beta a_w``, ``rejected_reward``, ``margin`` and ``accuracy =
    [chosen_reward > rejected_reward]``."""
    if beta <= 0:
        raise ValueError("beta must be positive")
    loss = -F.logsigmoid(beta * (chosen_avg_logp - rejected_avg_logp) - gamma)
    with torch.no_grad():
        cr, rr = beta * chosen_avg_logp.detach(), beta * rejected_avg_logp.detach()
        metrics = {"chosen_reward": cr, "rejected_reward": rr, "margin": cr - rr, "accuracy": (cr > rr).to(cr.dtype)}
    return loss, metrics


def pair_preference_loss(
    method: str,
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: Optional[torch.Tensor],
    ref_rejected_logp: Optional[torch.Tensor],
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    gamma: float = 1.0,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The loss of ``method`` (``algo.loss_type``) on pairs ``[B]`` of summed response log-probs
    (``*_tokens``: the responses' token counts, for the length-normalised methods), with metrics
    ``chosen_reward``, ``rejected_reward``, ``margin`` and ``accuracy`` (chosen preferred) for every
    method. kto on a pair: the chosen completion desirable, the rejected one not, summed, with
    ``z0 = 0`` (held-out evaluation: the reference point is a training-batch estimate)."""
    if method in DPO_LOSS_TYPES:
        return dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta=beta, loss_type=method,
                        label_smoothing=label_smoothing, reference_free=reference_free)
    if method == "kto":
        if ref_chosen_logp is None or ref_rejected_logp is None:
            raise ValueError("kto needs reference log-probs")
        z0 = torch.zeros((), dtype=chosen_logp.dtype, device=chosen_logp.device)
        kw = dict(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
        lc, mc = kto_loss(chosen_logp, ref_chosen_logp, torch.ones_like(chosen_logp, dtype=torch.bool), z0, **kw)
        lr, mr = kto_loss(rejected_logp, ref_rejected_logp, torch.zeros_like(rejected_logp, dtype=torch.bool), z0, **kw)
        cr, rr = mc["reward"], mr["reward"]
        return lc + lr, {"chosen_reward": cr, "rejected_reward": rr, "margin": cr - rr, "accuracy": (cr > rr).to(cr.dtype)}
    a_w = chosen_logp / chosen_tokens.to(chosen_logp.dtype).clamp(min=1)
    a_l = rejected_logp / rejected_tokens.to(rejected_logp.dtype).clamp(min=1)
    if method == "orpo":
        return orpo_loss(a_w, a_l, lam=beta)
    if method == "simpo":
        return simpo_loss(a_w, a_l, beta=beta, gamma=gamma)
    raise ValueError(f"unknown preference method {method!r}; expected one of {PREFERENCE_METHODS}")


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
