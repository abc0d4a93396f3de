"""The RL objective, whole, as pure torch: what the ``algo`` settings turn a batch into.

Two halves, called from two places:

* ``advantages`` (the driver, ``rlhf.loops.rl``, once per step on the whole batch): reward
  shaping (DAPO's overlong penalty, batch normalisation and clipping of the scores), the KL
  penalty in the reward, on-policy distillation's per-token rewards from the teacher, the
  registered advantage estimator (``algo.estimator``) and the whitening of its advantages;
* ``policy_loss_terms`` (the policy worker, ``rlhf.workers.policy``, per micro-batch): the
  registered policy loss (``algo.policy_loss``), minus the entropy bonus, plus the KL loss,
  aggregated by ``algo.loss_agg`` with the optimizer step's global denominator
  (``rlhf.algos.losses.micro_batch_loss``), and the statistics the worker logs.

Both are methods of ``Objective``, made once per process from the ``algo`` settings: it imports
``algo.plugins`` and looks the parts up by name in ``rlhf.algos.registry`` when it is made (the
loop makes one for the run, the policy worker one at setup), so a step calls the parts directly.
``advantages(algo, ...)`` and ``policy_loss_terms(algo, ...)`` make one for a single call.

The critic's loss (``rlhf.algos.losses.value_loss``) needs nothing beyond the advantages' returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from rlhf.algos.advantages import compute_advantages, masked_mean, masked_whiten
from rlhf.algos.distill import distill_metrics, distill_token_rewards
from rlhf.algos.kl import kl_penalty
from rlhf.algos.losses import PolicyLossInputs, micro_batch_loss
from rlhf.algos.registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, load_plugins
from rlhf.algos.shaping import normalize_scores, overlong_penalty

if TYPE_CHECKING:
    from rlhf.spec.schema import RLAlgo

__all__ = ["Advantages", "Objective", "PolicyLossTerms", "advantages", "distill_rewards", "kl_in_reward",
           "overlong_buffer", "policy_loss_terms", "shape_scores"]


# ----------------------------------------------------------------------------- the steps of the two halves


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, T], float32
    returns: Optional[torch.Tensor]  # [B, T] float32 for estimators with a critic, else None
    metrics: dict[str, float]


def overlong_buffer(algo: RLAlgo, max_response_tokens: int) -> Optional[int]:
    """DAPO's overlong buffer in tokens: ``algo.overlong_buffer``, or ``algo.overlong_buffer_fraction``
    of the length limit rounded up (so a preset fits any limit); None = no penalty."""
    if algo.overlong_buffer_fraction is not None:
        return min(max_response_tokens, math.ceil(algo.overlong_buffer_fraction * max_response_tokens))
    return algo.overlong_buffer


def shape_scores(algo: RLAlgo, scores: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor,
                 max_response_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores ``[B]`` after DAPO's soft overlong penalty (``algo.overlong_buffer``; a sample cut at
    the length limit, ``truncated``, pays the full penalty) and the batch normalisation and
    clipping of ``algo.reward_normalize`` / ``algo.reward_clip``."""
    out: dict[str, float] = {}
    scores = scores.clone()
    buffer = overlong_buffer(algo, max_response_tokens)
    if buffer is not None:  # validation keeps it in (0, max_response_tokens]
        pen = overlong_penalty(mask.sum(-1), max_response_tokens, buffer, algo.overlong_penalty)
        pen = torch.where(truncated, torch.full_like(pen, -algo.overlong_penalty), pen)
        scores = scores + pen
        out["reward/overlong_penalty"] = float(pen.mean())
    if algo.reward_normalize or algo.reward_clip is not None:
        scores = normalize_scores(scores, "batch" if algo.reward_normalize else "none", algo.reward_clip)
    return scores, out


def kl_in_reward(algo: RLAlgo, policy_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                 kl_coef: float, estimator: Any = None) -> tuple[Optional[torch.Tensor], dict[str, float]]:
    """The per-token KL to the reference (``kl/mean``) and, with ``algo.kl.placement=reward``, the
    token rewards ``-kl_coef * kl`` it adds (``kl_coef``: the KL controller's current value;
    ``estimator``: the registered KL estimator, looked up by ``algo.kl.estimator`` if not given)."""
    kl = kl_penalty(policy_logp, ref_logp, estimator or algo.kl.estimator, algo.kl.clamp, mask)
    metrics = {"kl/mean": float(masked_mean(kl, mask))}
    if algo.kl.placement == "reward" and kl_coef > 0:
        return -kl_coef * kl, metrics
    return None, metrics


def distill_rewards(algo: RLAlgo, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation's per-token rewards (``algo.teacher``: divergence, beta, coef, clamp;
    ``rlhf.algos.distill``) and its metrics (``distill/reverse_kl``, ...)."""
    t = algo.teacher
    r = distill_token_rewards(student_logp, teacher_logp, mask, t.divergence, t.beta, t.coef, t.clamp)
    return r, distill_metrics(student_logp, teacher_logp, mask)


@dataclass
class PolicyLossTerms:
    loss: torch.Tensor  # this micro-batch's loss, to back-propagate as is (micro_batch_loss)
    pg_loss: torch.Tensor  # detached: its share of the optimizer step's global policy loss
    stats: dict[str, torch.Tensor]  # detached means over its policy tokens (kl_loss, clip_frac, entropy, ...)
    tokens: torch.Tensor  # its policy tokens (a 0-d tensor on the batch's device): the weight of its stats


# ----------------------------------------------------------------------------- the objective, its parts resolved once


class Objective:
    """The objective of one ``algo``: its registered parts (advantage estimator, policy loss, KL
    estimator) looked up once, after importing ``algo.plugins``, and the two halves below. An
    unknown name fails here, when the loop or the worker makes it, not in a step."""

    def __init__(self, algo: RLAlgo):
        load_plugins(algo.plugins)
        self.algo = algo
        self.estimator = ADVANTAGE_ESTIMATORS.get(algo.estimator)
        # whether advantages are whitened over the batch: the estimator's ``whiten`` (GAE, as PPO
        # does; returns stay unwhitened for the critic), unless ``algo.whiten_advantages`` is false
        self.whiten = ADVANTAGE_ESTIMATORS.info(algo.estimator).whiten and algo.whiten_advantages
        self.policy_loss = POLICY_LOSSES.get(algo.policy_loss)
        self.kl_estimator = KL_ESTIMATORS.get(algo.kl.estimator)

    # ------------------------------------------------------------------------- the driver's half

    def advantages(self, *, scores: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor,
                   max_response_tokens: int, values: Optional[torch.Tensor] = None,
                   policy_logp: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
                   kl_coef: float = 0.0, teacher_logp: Optional[torch.Tensor] = None,
                   student_logp: Optional[torch.Tensor] = None) -> Advantages:
        """A step's advantages (and returns) from its scores ``[B]``: shaped scores, KL in the
        reward when ``ref_logp`` is given, on-policy distillation's per-token rewards when
        ``teacher_logp`` is (``rlhf.algos.distill``, measured at ``student_logp``), the estimator,
        whitening. ``policy_logp`` and ``student_logp`` are the sampled tokens' log-probs under the
        policy that sampled them (the old policy's, or the rollout engine's when there is no old pass)."""
        algo = self.algo
        scores, metrics = shape_scores(algo, scores, mask, truncated, max_response_tokens)
        token_rewards = None
        if ref_logp is not None:
            token_rewards, kl_metrics = kl_in_reward(algo, policy_logp, ref_logp, mask, kl_coef, self.kl_estimator)
            metrics.update(kl_metrics)
        if teacher_logp is not None:
            distill, distill_stats = distill_rewards(algo, student_logp, teacher_logp, mask)
            token_rewards = distill if token_rewards is None else token_rewards + distill
            metrics.update(distill_stats)
        adv, ret = compute_advantages(
            self.estimator, mask=mask, scores=scores, token_rewards=token_rewards, values=values,
            group_size=algo.group_size, gamma=algo.gamma, lam=algo.lam, normalize_std=algo.normalize_std)
        if self.whiten:
            adv = masked_whiten(adv, mask)
        metrics["advantages/mean"] = float(masked_mean(adv, mask))
        metrics["advantages/abs_mean"] = float(masked_mean(adv.abs(), mask))
        return Advantages(adv.float(), ret.float() if ret is not None else None, metrics)

    # ------------------------------------------------------------------------- the worker's half

    def policy_loss_terms(self, logp: torch.Tensor, entropy: torch.Tensor, mb: Mapping[str, Any],
                          denominator: float, dp_world_size: int) -> PolicyLossTerms:
        """The policy's loss on one micro-batch ``mb`` (``response_mask``, ``advantages`` and, when
        present, ``old_logp``, ``ref_logp``, ``rollout_logp``; ``[B, T]``) given this forward's
        ``logp`` and ``entropy``::

            loss = agg(policy_loss - entropy_coef * entropy + kl.coef * kl)    (kl with placement=loss)

        Without ``old_logp`` the update is exactly on-policy: the ratio's anchor is ``logp`` itself."""
        algo = self.algo
        mask = mb["response_mask"]
        tokens = mask.sum()  # a tensor: reading it here would wait for the forward (a host sync per micro-batch)
        n_tok = tokens.clamp(min=1)
        old = mb["old_logp"] if "old_logp" in mb else logp.detach()
        per_token, part_stats = self.policy_loss(PolicyLossInputs(
            logp=logp, old_logp=old, advantages=mb["advantages"], mask=mask,
            rollout_logp=mb.get("rollout_logp") if algo.tis_cap is not None else None,
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
            ratio_level=algo.ratio_level, tis_cap=algo.tis_cap, tau_pos=algo.tau_pos, tau_neg=algo.tau_neg))
        total = per_token
        stats: dict[str, torch.Tensor] = {}
        if algo.entropy_coef > 0:
            total = total - algo.entropy_coef * entropy
        if algo.kl.coef > 0 and algo.kl.placement == "loss" and "ref_logp" in mb:
            kl = kl_penalty(logp, mb["ref_logp"], self.kl_estimator, algo.kl.clamp, mask)
            total = total + algo.kl.coef * kl
            stats["kl_loss"] = (kl.detach() * mask).sum().double() / n_tok
        loss = micro_batch_loss(total, mask, algo.loss_agg, denominator, dp_world_size)
        pg = micro_batch_loss(per_token.detach(), mask, algo.loss_agg, denominator, 1)
        stats.update({name: v.detach() for name, v in part_stats.items()})
        stats["entropy"] = (entropy.detach() * mask).sum().double() / n_tok
        return PolicyLossTerms(loss, pg, stats, tokens)


def advantages(algo: RLAlgo, **inputs: Any) -> Advantages:
    """``Objective(algo).advantages(**inputs)``, for a single call (a loop keeps its ``Objective``)."""
    return Objective(algo).advantages(**inputs)


def policy_loss_terms(algo: RLAlgo, logp: torch.Tensor, entropy: torch.Tensor, mb: Mapping[str, Any],
                      denominator: float, dp_world_size: int) -> PolicyLossTerms:
    """``Objective(algo).policy_loss_terms(...)``, for a single call (the worker keeps its ``Objective``)."""
    return Objective(algo).policy_loss_terms(logp, entropy, mb, denominator, dp_world_size)
