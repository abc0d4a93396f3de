"""The policy losses cispo (MiniMax-M1) and sapo (SAPO) against plain-Python float64 references
written from the papers' formulas: per-token values, d loss_t / d logp_t, the statistics, the
aggregated objective, and (sapo, a smooth function) autograd's gradient against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos.losses import PolicyLossInputs, aggregate, cispo_policy_loss, policy_loss, sapo_policy_loss
from rlhf.algos.registry import POLICY_LOSSES
from tests.helpers import close

D = torch.float64


def _inputs(B=5, T=20, spread=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    olp = -torch.rand(B, T, dtype=D, generator=g) * 2
    lp = (olp + spread * torch.randn(B, T, dtype=D, generator=g)).requires_grad_()
    A = torch.randn(B, T, dtype=D, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.2).to(D)
    m[-1] = 0  # an all-masked row
    return lp, olp, A, m


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def ref_cispo(lp, olp, A, m, eps_low, eps_high):
    """MiniMax-M1 eq. 4, per token: l = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi;
    d l / d log pi = -clip(r) * A (the weight is a constant to the gradient)."""
    loss, grad, n, n_low, n_high = [], [], 0, 0, 0
    for b in range(len(lp)):
        lr, gr = [], []
        for t in range(len(lp[0])):
            if m[b][t] == 0:
                lr.append(0.0), gr.append(0.0)
                continue
            r = math.exp(lp[b][t] - olp[b][t])
            w = min(max(r, 1 - eps_low), 1 + eps_high)
            lr.append(-w * A[b][t] * lp[b][t])
            gr.append(-w * A[b][t])
            n += 1
            n_low += r < 1 - eps_low
            n_high += r > 1 + eps_high
        loss.append(lr), grad.append(gr)
    return loss, grad, {"clip_frac": (n_low + n_high) / n, "clip_frac_low": n_low / n, "clip_frac_high": n_high / n}


def ref_sapo(lp, olp, A, m, tau_pos, tau_neg):
    """SAPO: l = -(4/tau) sigmoid(tau (r - 1)) A, tau by the sign of A;
    d l / d log pi = -(4/tau) * s(1-s) * tau * r * A = -4 s (1-s) r A."""
    loss, grad, gate, n = [], [], 0.0, 0
    for b in range(len(lp)):
        lr, gr = [], []
        for t in range(len(lp[0])):
            if m[b][t] == 0:
                lr.append(0.0), gr.append(0.0)
                continue
            r = math.exp(lp[b][t] - olp[b][t])
            a = A[b][t]
            tau = tau_pos if a > 0 else tau_neg
            s = _sigmoid(tau * (r - 1))
            lr.append(-(4 / tau) * s * a)
            gr.append(-4 * s * (1 - s) * r * a)
            gate += 4 * s * (1 - s)
            n += 1
        loss.append(lr), grad.append(gr)
    return loss, grad, {"gate_mean": gate / n}


@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.2, 0.2), (0.5, 4.0)])
def test_cispo_vs_reference(eps):
    lp, olp, A, m = _inputs(seed=1)
    lp_in = torch.where(m != 0, lp, torch.full_like(lp, 1e6))  # garbage at masked positions must not matter
    loss, stats = cispo_policy_loss(PolicyLossInputs(lp_in, olp, A, m, clip_low=eps[0], clip_high=eps[1]))
    loss.sum().backward()
    rl, rg, rs = ref_cispo(lp.tolist(), olp.tolist(), A.tolist(), m.tolist(), *eps)
    close(loss, rl)
    close(lp.grad, rg)
    for k, v in rs.items():
        close(stats[k], torch.tensor(v, dtype=D))
    assert rs["clip_frac_high"] > 0  # the inputs exercise the clip
    assert not any(v.requires_grad for v in stats.values())


def test_cispo_objective_and_the_tokens_the_clip_drops():
    """Token-mean aggregation gives the paper's J = 1/sum|o_i| sum_i sum_t sg(w) A log pi; a token
    whose ratio left the range keeps its gradient, where the clipped surrogate's is 0."""
    lp, olp, A, m = _inputs(seed=2, spread=0.8)
    loss, _ = cispo_policy_loss(PolicyLossInputs(lp, olp, A, m, clip_low=1.0, clip_high=0.28))
    J = aggregate(loss, m, "token_mean")
    L, O, AA, M = lp.tolist(), olp.tolist(), A.tolist(), m.tolist()
    n = sum(sum(row) for row in M)
    want = sum(-min(math.exp(L[b][t] - O[b][t]), 1.28) * AA[b][t] * L[b][t]
               for b in range(len(L)) for t in range(len(L[0])) if M[b][t]) / n
    close(J, want)
    g_cispo, = torch.autograd.grad(J, lp)
    clip_loss, _ = policy_loss(lp, olp, A, m, clip_low=0.2, clip_high=0.28)
    g_clip, = torch.autograd.grad(aggregate(clip_loss, m, "token_mean"), lp)
    dropped = (m != 0) & (g_clip == 0)
    assert dropped.any() and (g_cispo[dropped] != 0).all()


@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_vs_reference(taus):
    lp, olp, A, m = _inputs(seed=3)
    lp_in = torch.where(m != 0, lp, torch.full_like(lp, 1e6))
    loss, stats = sapo_policy_loss(PolicyLossInputs(lp_in, olp, A, m, tau_pos=taus[0], tau_neg=taus[1]))
    loss.sum().backward()
    rl, rg, rs = ref_sapo(lp.tolist(), olp.tolist(), A.tolist(), m.tolist(), *taus)
    close(loss, rl)
    close(lp.grad, rg)
    close(stats["gate_mean"], torch.tensor(rs["gate_mean"], dtype=D))


def test_sapo_on_policy_is_the_policy_gradient():
    """At ratio 1 the gate is 1: the gradient is -A grad log pi, as the clipped surrogate's."""
    _, olp, A, m = _inputs(seed=4)
    lp = olp.clone().requires_grad_()
    loss, stats = sapo_policy_loss(PolicyLossInputs(lp, olp, A, m))
    g, = torch.autograd.grad(loss.sum(), lp)
    close(g, -A * m)
    close(stats["gate_mean"], torch.tensor(1.0, dtype=D))


def test_sapo_gradcheck():
    """SAPO's loss is a smooth function of log pi: autograd's gradient against finite differences.
    (CISPO's is not the gradient of its value, by design: the weight is held constant, so its
    gradient is checked against the formula above instead.)"""
    lp, olp, A, m = _inputs(B=3, T=6, seed=5)
    torch.autograd.gradcheck(lambda x: sapo_policy_loss(PolicyLossInputs(x, olp, A, m))[0],
                             (lp.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_rollout_correction(name):
    """The truncated importance weight (algo.tis_cap) multiplies the loss, as for clip."""
    fn = POLICY_LOSSES.get(name)
    lp, olp, A, m = _inputs(B=3, T=6, seed=5)
    rlp = olp - 2.0  # weights e^2, capped at 1.5
    base, _ = fn(PolicyLossInputs(lp, olp, A, m, clip_low=1.0, clip_high=0.28))
    corr, st = fn(PolicyLossInputs(lp, olp, A, m, rollout_logp=rlp, tis_cap=1.5, clip_low=1.0, clip_high=0.28))
    close(corr, 1.5 * base)
    close(st["tis_capped_frac"], torch.tensor(1.0, dtype=D))


def test_bad_arguments():
    lp, olp, A, m = _inputs(B=2, T=3)
    with pytest.raises(ValueError):
        cispo_policy_loss(PolicyLossInputs(lp, olp, A, m, clip_low=1.5))
    with pytest.raises(ValueError):
        sapo_policy_loss(PolicyLossInputs(lp, olp, A, m, tau_neg=0.0))
