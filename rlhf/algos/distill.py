"""On-policy distillation: the student (the policy) samples, a frozen teacher scores the sampled
tokens, and the per-token divergence from the teacher is the student's negative per-token reward,
used directly as the token's advantage (the ``distill`` estimator).

Papers: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD); Thinking Machines Lab 2025, "On-Policy Distillation" (Lu et al.);
Qwen3 Technical Report 2025 (its small models' on-policy distillation stage).

What is implemented, per sampled token ``y_t`` of the student's response, with ``s = log π_s(y_t)``
(the student's log-prob of the token it sampled, under the rollout temperature) and
``t = log π_t(y_t)`` (the teacher's, same context, same temperature)::

    reverse_kl:   A_t = -coef · (s - t)
    jsd (β):      A_t = -coef · (1 - β) · (s - log m),   log m = logaddexp(log β + t, log(1 - β) + s)

and the policy loss is the usual one (``algo.policy_loss``; on-policy its gradient is
``-Σ A_t ∇ log π_s(y_t)``). Advantages are not summed over later tokens (discount 0, as the
Thinking Machines recipe): each position's divergence is credited to its own token, its effect on
later contexts is not followed (GKD's token-level objective likewise takes each prefix as given).

Why these weights give the divergences' gradients. At one position with the context fixed, a
divergence ``D = Σ_y g(π_s(y), π_t(y))`` has ``∇D = Σ_y ∂g/∂π_s(y) · π_s(y) ∇log π_s(y)
= E_{y~π_s}[∂g/∂π_s(y) · ∇log π_s(y)]``; a constant added to ``∂g/∂π_s`` changes nothing in
expectation (``E[∇log π_s] = 0``). Reverse KL, ``g = π_s log(π_s/π_t)``: ``∂g/∂π_s = log(π_s/π_t) + 1``.
GKD's generalised Jensen-Shannon divergence, in the form TRL's ``GKDTrainer`` computes it,
``JSD_β = β KL(π_t ‖ M) + (1 - β) KL(π_s ‖ M)`` with ``M = β π_t + (1 - β) π_s``:
``∂JSD_β/∂π_s(y) = (1 - β) log(π_s(y)/M(y))`` (the other terms cancel). So the expected gradient of
the loss with these advantages is ``coef`` times the gradient of the divergence at every position,
using only the sampled tokens' log-probs: no teacher logits cross the network. ``jsd`` needs
``0 < β < 1``; its limits are forward KL (β → 0, after dividing by β, which this estimator, sampling
from the student, does not offer) and reverse KL (β → 1, after dividing by 1 - β: ``reverse_kl``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from rlhf.algos.registry import DISTILL_DIVERGENCES, register_advantage_estimator

__all__ = ["DIVERGENCES", "distill_metrics", "distill_token_rewards", "divergence_weight"]

DIVERGENCES = DISTILL_DIVERGENCES


def divergence_weight(student_logp: torch.Tensor, teacher_logp: torch.Tensor, divergence: str = "reverse_kl",
                      beta: float = 0.5) -> torch.Tensor:
    """The per-token weight ``w`` whose ``E_{y~π_s}[w(y) ∇log π_s(y)]`` is the divergence's gradient
    at a position (module docstring): ``s - t`` (reverse_kl) or ``(1 - β)(s - log m)`` (jsd)."""
    if divergence == "reverse_kl":
        return student_logp - teacher_logp
    if divergence == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
        log_m = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log1p(-beta))
        return (1.0 - beta) * (student_logp - log_m)
    raise ValueError(f"divergence {divergence!r} is not one of {', '.join(DIVERGENCES)}")


@torch.no_grad()
def distill_token_rewards(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                          divergence: str = "reverse_kl", beta: float = 0.5, coef: float = 1.0,
                          clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token rewards ``-coef · w`` ``[B, T]`` (0 where ``mask`` is 0), ``w`` from
    :func:`divergence_weight`; ``clamp`` bounds ``w`` to ``[-clamp, clamp]`` (None: unbounded)."""
    dt = torch.promote_types(torch.promote_types(student_logp.dtype, teacher_logp.dtype), torch.float32)
    w = divergence_weight(student_logp.to(dt), teacher_logp.to(dt), divergence, beta)
    if clamp is not None:
        w = w.clamp(-clamp, clamp)
    return torch.where(mask != 0, -coef * w, torch.zeros((), dtype=dt, device=w.device))


@torch.no_grad()
def distill_metrics(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl``: the mean of ``s - t`` over the policy tokens (an unbiased estimate of
    the per-token reverse KL to the teacher: what distillation drives to 0), ``distill/teacher_logp``
    and ``distill/student_logp``: the mean log-probs of the sampled tokens under each."""
    m = (mask != 0).to(torch.float64)
    n = float(m.sum().clamp(min=1))

    def mean(x: torch.Tensor) -> float:
        return float((torch.where(mask != 0, x.double(), torch.zeros((), dtype=torch.float64)) * m).sum()) / n

    return {"distill/reverse_kl": mean(student_logp - teacher_logp), "distill/teacher_logp": mean(teacher_logp),
            "distill/student_logp": mean(student_logp)}


@register_advantage_estimator("distill")
def distill_estimator(x):  # x: rlhf.algos.advantages.AdvantageInputs (not imported here: advantages imports this module)
    """On-policy distillation's advantages: the per-token rewards as they are (``token_rewards``,
    the teacher's :func:`distill_token_rewards`, plus a KL-in-reward term if configured), not
    summed over later tokens; the outcome scores are not used. No returns."""
    if x.token_rewards is None:
        raise ValueError("distill needs token_rewards (the teacher's per-token divergence)")
    r = x.token_rewards.to(torch.promote_types(x.token_rewards.dtype, torch.float32))
    return torch.where(x.mask != 0, r, torch.zeros((), dtype=r.dtype, device=r.device)), None
