"""KTO, ORPO and SimPO (rlhf.algos.preference) against plain-Python float64 references written from
the papers' formulas (values and d loss / d log-prob), autograd against finite differences, and
against TRL's own implementation (trl==1.16.0) on random inputs.

Tolerances: float64 references 1e-10 (tests.helpers.close); TRL's SimPO and KTO run in the inputs'
float64, compared at 1e-12; TRL's ORPO casts to float32 first, compared at rtol 1e-5 / atol 1e-6."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlhf.algos.preference import (kto_loss, kto_reference_point, log_odds, orpo_loss, pair_preference_loss,
                                   simpo_loss)
from tests.helpers import close

D = torch.float64


def _sig(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _avg_logps(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # mean token log-probs in (-3, -0.01): probabilities from 0.05 to 0.99
    a = -(torch.rand(n, dtype=D, generator=g) * 3 + 0.01)
    b = -(torch.rand(n, dtype=D, generator=g) * 3 + 0.01)
    return a.requires_grad_(), b.requires_grad_()


# ----------------------------------------------------------------------------- KTO


def ref_kto(lp, ref, desirable, kl_lp, kl_ref, beta, wd, wu):
    """KTO eq. 8: z0 = max(0, mean(kl_lp - kl_ref)); L = lambda_y - v. d L / d lp (z0 a constant):
    desirable -wd * beta * s(1-s), s = sigmoid(beta (r - z0)); undesirable +wu * beta * s(1-s),
    s = sigmoid(beta (z0 - r))."""
    z0 = max(0.0, sum(a - b for a, b in zip(kl_lp, kl_ref)) / len(kl_lp))
    loss, grad = [], []
    for x, y, d in zip(lp, ref, desirable):
        r = x - y
        if d:
            s = _sig(beta * (r - z0))
            loss.append(wd * (1 - s)), grad.append(-wd * beta * s * (1 - s))
        else:
            s = _sig(beta * (z0 - r))
            loss.append(wu * (1 - s)), grad.append(wu * beta * s * (1 - s))
    return loss, grad, z0


@pytest.mark.parametrize("beta,wd,wu,shift", [(0.1, 1.0, 1.0, 0.0), (0.5, 1.33, 1.0, 3.0), (2.0, 1.0, 0.7, -3.0)])
def test_kto_vs_reference(beta, wd, wu, shift):
    """shift moves the mismatched pairs' log-ratios: z0 > 0, and (negative) z0 clamped to 0."""
    g = torch.Generator().manual_seed(11)
    n = 9
    lp = (torch.randn(n, dtype=D, generator=g) * 4 - 10).requires_grad_()
    ref = torch.randn(n, dtype=D, generator=g) * 4 - 10
    d = torch.rand(n, generator=g) > 0.4
    kl_lp = (torch.randn(n, dtype=D, generator=g) * 2 - 10 + shift).requires_grad_()
    kl_ref = torch.randn(n, dtype=D, generator=g) * 2 - 10
    z0 = kto_reference_point(kl_lp, kl_ref)
    loss, m = kto_loss(lp, ref, d, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    loss.sum().backward()
    rl, rg, rz = ref_kto(lp.tolist(), ref.tolist(), d.tolist(), kl_lp.tolist(), kl_ref.tolist(), beta, wd, wu)
    close(z0, rz)
    close(loss, rl)
    close(lp.grad, rg)
    assert kl_lp.grad is None  # z0 carries no gradient
    close(m["reward"], beta * (lp.detach() - ref))
    close(m["accuracy"], ((lp.detach() - ref > rz) == d).to(D))


# ----------------------------------------------------------------------------- ORPO


def ref_log_odds(a: float) -> float:
    return a - math.log(1 - math.exp(a))


def ref_orpo(aw, al, lam):
    """ORPO eqs. 6-7: L = -a_w - lam * log sigmoid(lo(a_w) - lo(a_l)), lo(a) = a - log(1 - e^a);
    d lo / d a = 1 / (1 - e^a)."""
    loss, gw, gl = [], [], []
    for x, y in zip(aw, al):
        dlt = ref_log_odds(x) - ref_log_odds(y)
        s = _sig(dlt)
        loss.append(-x - lam * math.log(s))
        gw.append(-1 - lam * (1 - s) / (1 - math.exp(x)))
        gl.append(lam * (1 - s) / (1 - math.exp(y)))
    return loss, gw, gl


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_vs_reference(lam):
    aw, al = _avg_logps(12, seed=12)
    loss, m = orpo_loss(aw, al, lam=lam)
    loss.sum().backward()
    rl, gw, gl = ref_orpo(aw.tolist(), al.tolist(), lam)
    close(loss, rl)
    close(aw.grad, gw)
    close(al.grad, gl)
    close(m["accuracy"], (aw.detach() > al.detach()).to(D))  # the odds are monotone in the probability


def test_log_odds_is_accurate_near_both_ends():
    for a in (-1e-5, -1e-3, -0.5, -math.log(2.0), -0.9, -5.0, -40.0):
        close(log_odds(torch.tensor(a, dtype=D)), ref_log_odds(a), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(log_odds(torch.tensor([0.0, -1e-30]))).all()  # p = 1 capped, not infinite


# ----------------------------------------------------------------------------- SimPO


def ref_simpo(aw, al, beta, gamma):
    """SimPO eq. 6: L = -log sigmoid(beta (a_w - a_l) - gamma); d L / d a_w = -beta (1 - s)."""
    loss, gw = [], []
    for x, y in zip(aw, al):
        s = _sig(beta * (x - y) - gamma)
        loss.append(-math.log(s))
        gw.append(-beta * (1 - s))
    return loss, gw


@pytest.mark.parametrize("beta,gamma", [(2.0, 1.0), (2.5, 0.3), (10.0, 5.0)])
def test_simpo_vs_reference(beta, gamma):
    aw, al = _avg_logps(12, seed=13)
    loss, m = simpo_loss(aw, al, beta=beta, gamma=gamma)
    loss.sum().backward()
    rl, gw = ref_simpo(aw.tolist(), al.tolist(), beta, gamma)
    close(loss, rl)
    close(aw.grad, gw)
    close(al.grad, [-x for x in gw])
    close(m["margin"], beta * (aw.detach() - al.detach()))


def test_pair_loss_normalises_by_length_and_gradchecks():
    """orpo and simpo on summed log-probs divide by each response's token count; the losses are
    smooth in the log-probs: autograd against finite differences."""
    g = torch.Generator().manual_seed(14)
    n = 6
    tc, tr = torch.randint(1, 9, (n,), generator=g), torch.randint(1, 9, (n,), generator=g)
    sc = (-(torch.rand(n, dtype=D, generator=g) * 2 + 0.05) * tc).requires_grad_()
    sr = (-(torch.rand(n, dtype=D, generator=g) * 2 + 0.05) * tr).requires_grad_()
    for method, fn, kw in (("orpo", lambda a, b: orpo_loss(a, b, lam=0.1), {}),
                           ("simpo", lambda a, b: simpo_loss(a, b, beta=2.0, gamma=1.0), {"gamma": 1.0})):
        beta = 0.1 if method == "orpo" else 2.0
        got, _ = pair_preference_loss(method, sc, sr, None, None, tc, tr, beta=beta, reference_free=True, **kw)
        want, _ = fn(sc / tc, sr / tr)
        close(got, want)
        torch.autograd.gradcheck(
            lambda a, b: pair_preference_loss(method, a, b, None, None, tc, tr, beta=beta, reference_free=True, **kw)[0],
            (sc.detach().clone().requires_grad_(), sr.detach().clone().requires_grad_()))
    ref_c, ref_r = sc.detach() + 0.3, sr.detach() - 0.2
    torch.autograd.gradcheck(
        lambda a: kto_loss(a, ref_c, torch.tensor([True, False] * 3), torch.tensor(0.4, dtype=D), beta=0.5)[0],
        (sc.detach().clone().requires_grad_(),))
    with pytest.raises(ValueError):
        pair_preference_loss("nope", sc, sr, None, None, tc, tr, beta=0.1)


# ----------------------------------------------------------------------------- TRL


@pytest.fixture(scope="module")
def trl():
    """TRL's trainers' modules (imports only: their loss methods are called on stand-in objects)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    pytest.importorskip("trl", minversion="1.16.0")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer

    return SimpleNamespace(CPO=CPOTrainer, ORPO=ORPOTrainer, KTO=KTOTrainer)


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)


def test_orpo_matches_trl(trl):
    aw, al = _avg_logps(64, seed=21)
    stand_in = SimpleNamespace(beta=0.1, accelerator=_accelerator())
    trl_losses, _, _, _, trl_lor = trl.ORPO.odds_ratio_loss(stand_in, aw, al)
    ours, m = orpo_loss(aw, al, lam=0.1)
    # TRL returns beta * log sigmoid(log odds ratio) and subtracts its mean from the NLL
    torch.testing.assert_close((ours - m["nll"]).float(), -trl_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["log_odds_ratio"].mean().float(), trl_lor, rtol=1e-5, atol=1e-6)


def test_simpo_matches_trl(trl):
    aw, al = _avg_logps(64, seed=22)
    for beta, gamma in ((2.0, 1.0), (2.5, 1.4)):
        stand_in = SimpleNamespace(beta=beta, simpo_gamma=gamma, loss_type="simpo", label_smoothing=0.0, alpha=0.0,
                                   accelerator=_accelerator())
        trl_losses, trl_cr, trl_rr = trl.CPO.cpo_loss(stand_in, aw, al)
        ours, m = simpo_loss(aw, al, beta=beta, gamma=gamma)
        close(ours, trl_losses, rtol=1e-12, atol=1e-12)
        close(m["chosen_reward"], trl_cr, rtol=1e-12, atol=1e-12)


class _TableModel:
    """A stand-in for TRL's model call with ``fused_lm_head=True``: row r of ``input_ids`` starts with
    the token r, and its per-token log-probs are row r of ``table`` where the label is kept."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, input_ids, labels, **_):
        keep = (labels[:, 1:] != -100).to(self.table.dtype)
        lp = self.table[input_ids[:, 0]] * keep
        zeros = torch.zeros_like(lp)
        return SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros)


def test_kto_matches_trl(trl):
    """TRL's KTO loss (KTOTrainer._compute_loss with precomputed reference log-probs and its KL
    estimate on mismatched pairs) against rlhf's, loss and gradient, on random token log-probs."""
    g = torch.Generator().manual_seed(23)
    n, T, P = 8, 7, 3  # examples, sequence length, prompt tokens
    table = (-torch.rand(2 * n, T - 1, dtype=D, generator=g) * 3).requires_grad_()
    comp = torch.zeros(2 * n, T, dtype=torch.long)
    for r in range(2 * n):
        comp[r, P:P + int(torch.randint(1, T - P + 1, (1,), generator=g))] = 1
    ids = torch.arange(2 * n)[:, None].expand(2 * n, T).clone()
    label = torch.rand(n, generator=g) > 0.5
    label[0], label[1] = True, False
    ref = -torch.rand(n, dtype=D, generator=g) * 6
    ref_kl = -torch.rand(n, dtype=D, generator=g) * 6
    batch = {"input_ids": ids[:n], "attention_mask": torch.ones(n, T, dtype=torch.long), "completion_mask": comp[:n],
             "KL_input_ids": ids[n:], "KL_attention_mask": torch.ones(n, T, dtype=torch.long),
             "KL_completion_mask": comp[n:], "label": label, "ref_logps": ref, "ref_KL_logps": ref_kl}
    for beta, wd, wu in ((0.1, 1.0, 1.0), (1.0, 1.33, 0.8)):
        stand_in = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_accelerator(), calculate_KL=True,
                                   precompute_ref_logps=True, loss_type="kto", beta=beta, desirable_weight=wd,
                                   undesirable_weight=wu, aux_loss_enabled=False, _tp_size=1, _total_train_tokens=0,
                                   _metrics=defaultdict(lambda: defaultdict(list)))
        stand_in._compute_kl_logps = lambda model, b, s=stand_in: trl.KTO._compute_kl_logps(s, model, b)
        trl_loss = trl.KTO._compute_loss(stand_in, _TableModel(table), batch, False)
        trl_grad, = torch.autograd.grad(trl_loss, table)
        # rlhf: summed completion log-probs (the model's token log-probs at completion positions)
        sums = (table * comp[:, 1:].to(D)).sum(-1)
        z0 = kto_reference_point(sums[n:], ref_kl)
        ours, _ = kto_loss(sums[:n], ref, label, z0, beta=beta, desirable_weight=wd, undesirable_weight=wu)
        our_grad, = torch.autograd.grad(ours.mean(), table)
        close(ours.mean(), trl_loss, rtol=1e-12, atol=1e-12)
        close(our_grad, trl_grad, rtol=1e-12, atol=1e-12)
        assert trl_grad.abs().sum() > 0
