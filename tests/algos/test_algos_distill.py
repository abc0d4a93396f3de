"""On-policy distillation's per-token advantages (rlhf.algos.distill) against float64 references
written from the formulas, and their gradients: the exact expectation over the vocabulary of the
sampled-token surrogate's gradient equals autograd's gradient of the full divergence (reverse KL;
GKD's generalised JSD in TRL's GKDTrainer form, written out here from its definition).

Tolerances: float64, 1e-10 (the references and the estimator are the same formulas in different
arrangements; only rounding differs); 1e-6 where the objective's float32 advantages enter.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos.distill import distill_metrics, distill_token_rewards, divergence_weight
from rlhf.algos.objective import advantages
from tests.helpers import close

D = torch.float64


def _probs(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(logits - logits.max())
    return e / e.sum()


def _reverse_kl(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) = sum_y s(y) log(s(y)/t(y)), from probabilities."""
    return (s * (s.log() - t.log())).sum()


def _gjsd(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD as TRL computes it: beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s."""
    m = beta * t + (1 - beta) * s
    return beta * (t * (t.log() - m.log())).sum() + (1 - beta) * (s * (s.log() - m.log())).sum()


def test_token_rewards_match_the_formulas_elementwise():
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(3, 5, generator=g, dtype=D) * 4  # log-probs of sampled tokens
    t = -torch.rand(3, 5, generator=g, dtype=D) * 6
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    r = distill_token_rewards(s, t, mask, "reverse_kl", coef=0.7)
    for b in range(3):
        for i in range(5):
            want = -0.7 * (s[b, i].item() - t[b, i].item()) if mask[b, i] else 0.0
            close(r[b, i], want)
    beta = 0.3
    r = distill_token_rewards(s, t, mask, "jsd", beta=beta, coef=2.0)
    for b in range(3):
        for i in range(5):
            ps, pt = math.exp(s[b, i].item()), math.exp(t[b, i].item())
            pm = beta * pt + (1 - beta) * ps
            want = -2.0 * (1 - beta) * math.log(ps / pm) if mask[b, i] else 0.0
            close(r[b, i], want)
    # clamp bounds the divergence term before the coefficient
    r = distill_token_rewards(s, t, mask, "reverse_kl", coef=1.0, clamp=0.5)
    close(r, torch.where(mask != 0, -(s - t).clamp(-0.5, 0.5), torch.zeros((), dtype=D)))


def test_masked_positions_ignore_inf_and_nan():
    s = torch.tensor([[-1.0, float("nan"), -float("inf")]], dtype=D)
    t = torch.tensor([[-2.0, -1.0, -1.0]], dtype=D)
    r = distill_token_rewards(s, t, torch.tensor([[1, 0, 0]]))
    close(r, torch.tensor([[-1.0, 0.0, 0.0]], dtype=D))


@pytest.mark.parametrize("divergence,beta", [("reverse_kl", None), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9)])
def test_expected_surrogate_gradient_is_the_divergence_gradient(divergence, beta):
    """At one position: E_{y~pi_s}[w(y) grad log pi_s(y)] (the policy gradient the loss takes with
    advantage -w) equals grad D(pi_s, pi_t) of the full divergence, for student logits theta."""
    g = torch.Generator().manual_seed(1)
    V = 7
    theta = torch.randn(V, generator=g, dtype=D, requires_grad=True)
    teacher = torch.randn(V, generator=g, dtype=D) * 2
    pt = _probs(teacher)
    ps = _probs(theta)
    full = _reverse_kl(ps, pt) if divergence == "reverse_kl" else _gjsd(ps, pt, beta)
    (want,) = torch.autograd.grad(full, theta)

    logs = torch.log_softmax(theta, -1)
    w = divergence_weight(logs.detach(), pt.log(), divergence, beta if beta is not None else 0.5)
    surrogate = (ps.detach() * w * logs).sum()  # sum_y pi_s(y) w(y) log pi_s(y), w and the weights fixed
    (got,) = torch.autograd.grad(surrogate, theta)
    close(got, want)


def test_policy_loss_on_policy_gives_that_gradient_for_a_sampled_token():
    """Through the objective: the distill estimator's advantages and the clip loss at ratio 1
    back-propagate -A grad log pi_s(y) for the sampled y, i.e. w(y) grad log pi_s(y)."""
    from types import SimpleNamespace as NS

    from rlhf.algos.objective import policy_loss_terms

    g = torch.Generator().manual_seed(2)
    theta = torch.randn(2, 3, 5, generator=g, dtype=D, requires_grad=True)  # [B, T, V] student logits
    tlog = torch.log_softmax(torch.randn(2, 3, 5, generator=g, dtype=D), -1)
    y = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    logp = torch.log_softmax(theta, -1).gather(-1, y[..., None])[..., 0]
    t_y = tlog.gather(-1, y[..., None])[..., 0]
    algo = NS(plugins=(), estimator="distill", whiten_advantages=True, overlong_buffer=None,
              overlong_buffer_fraction=None, reward_normalize=False, reward_clip=None,
              kl=NS(coef=0.0, placement="loss", estimator="k3", clamp=10.0), group_size=1, gamma=1.0, lam=1.0,
              normalize_std=True, teacher=NS(divergence="reverse_kl", beta=0.5, coef=1.0, clamp=None),
              policy_loss="clip", clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_level="token", tis_cap=None,
              tau_pos=1.0, tau_neg=1.05, entropy_coef=0.0, loss_agg="token_mean")
    adv = advantages(algo, scores=torch.zeros(2, dtype=D), mask=mask, truncated=torch.zeros(2, dtype=torch.bool),
                     max_response_tokens=3, teacher_logp=t_y, student_logp=logp.detach())
    # the objective hands the workers float32 advantages: compared at float32's resolution
    close(adv.advantages.double(), torch.where(mask != 0, -(logp.detach() - t_y), torch.zeros((), dtype=D)),
          atol=1e-6, rtol=1e-6)
    close(adv.metrics["distill/reverse_kl"], float(((logp.detach() - t_y) * mask).sum() / mask.sum()))
    n = float(mask.sum())
    terms = policy_loss_terms(algo, logp, torch.zeros_like(logp), {"response_mask": mask, "advantages": adv.advantages},
                              denominator=n, dp_world_size=1)
    (got,) = torch.autograd.grad(terms.loss, theta, retain_graph=True)
    (want,) = torch.autograd.grad(((logp.detach() - t_y) * logp * mask).sum() / n, theta)
    close(got, want, atol=1e-6, rtol=1e-6)


def test_metrics_are_masked_means():
    s = torch.tensor([[-1.0, -2.0, -9.0]], dtype=D)
    t = torch.tensor([[-1.5, -1.0, 0.0]], dtype=D)
    m = distill_metrics(s, t, torch.tensor([[1, 1, 0]]))
    close(m["distill/reverse_kl"], ((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    close(m["distill/teacher_logp"], (-1.5 - 1.0) / 2)
    close(m["distill/student_logp"], (-1.0 - 2.0) / 2)


def test_jsd_needs_beta_strictly_inside():
    with pytest.raises(ValueError, match="0 < beta < 1"):
        divergence_weight(torch.zeros(1), torch.zeros(1), "jsd", 1.0)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9, 1.0])
def test_gradient_matches_trl_gkd_generalized_jsd(beta, monkeypatch):
    """Cross-check against TRL's GKDTrainer.generalized_jsd_loss (full-vocabulary logits, its
    beta = 1 being reverse KL): its gradient w.r.t. the student's logits at each position equals the
    expectation over the vocabulary of our sampled-token surrogate's (1e-10, float64)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    pytest.importorskip("trl")
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:  # older TRL: the trainer at the top level
        from trl import GKDTrainer
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(1, 4, 9, generator=g, dtype=D, requires_grad=True)
    teacher = torch.randn(1, 4, 9, generator=g, dtype=D) * 1.5
    trl_loss = GKDTrainer.generalized_jsd_loss(theta, teacher, beta=beta, reduction="sum")
    (want,) = torch.autograd.grad(trl_loss, theta)

    logs = torch.log_softmax(theta, -1)
    w = divergence_weight(logs.detach(), torch.log_softmax(teacher, -1), "reverse_kl" if beta == 1.0 else "jsd",
                          beta)
    (got,) = torch.autograd.grad((logs.detach().exp() * w * logs).sum(), theta)
    close(got, want)
