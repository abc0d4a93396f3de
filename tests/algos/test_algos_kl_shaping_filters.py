"""KL estimators/controllers, reward shaping and filters vs. plain-Python references."""

import math
import statistics

import pytest
import torch

from rlhf.algos.filters import dynamic_sampling_filter
from rlhf.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty
from rlhf.algos.shaping import last_policy_token_index, normalize_scores, overlong_penalty, token_level_rewards

from tests.helpers import close

D = torch.float64


def mask_with_holes(B, T):
    m = (torch.rand(B, T) > 0.3).to(D)
    m[0] = 0  # empty row
    m[1, -3:] = 0  # trailing tool/padding tokens: last policy token is earlier
    m[1, 2] = 1
    return m


# ----------------------------------------------------------------------------- KL


def ref_kl(x, est):
    if est == "k1":
        return x
    if est == "k2":
        return 0.5 * x * x
    return math.exp(-x) - 1.0 + x


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_penalty_vs_formula(est):
    torch.manual_seed(0)
    lp, rlp = -torch.rand(4, 9, dtype=D) * 3, -torch.rand(4, 9, dtype=D) * 3
    out = kl_penalty(lp, rlp, est)
    exp = [[ref_kl(lp[b, t].item() - rlp[b, t].item(), est) for t in range(9)] for b in range(4)]
    close(out, exp)
    m = mask_with_holes(4, 9)
    outm = kl_penalty(lp, rlp, est, mask=m)
    close(outm, [[exp[b][t] * m[b, t].item() for t in range(9)] for b in range(4)])
    if est in ("k2", "k3"):
        assert torch.all(out >= 0)


def test_kl_k3_is_unbiased_estimate_of_kl():
    # sample from a categorical pi, compare the mean of k1/k3 with the exact KL(pi || ref)
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(6, dtype=D), 0)
    q = torch.softmax(torch.randn(6, dtype=D), 0)
    exact = sum(p[i].item() * math.log(p[i].item() / q[i].item()) for i in range(6))
    x = torch.multinomial(p, 200000, replacement=True)
    for est in ("k1", "k3"):
        val = kl_penalty(p.log()[x], q.log()[x], est, clamp=None).mean().item()
        assert abs(val - exact) < 0.02 * max(1.0, exact)


def test_kl_clamp_and_finite_gradients():
    lp = torch.tensor([[0.0, -200.0, 200.0, 3.0]], dtype=torch.float32, requires_grad=True)
    rlp = torch.zeros(1, 4)
    for est in ("k1", "k2", "k3"):
        out = kl_penalty(lp, rlp, est, clamp=10.0)
        assert torch.all(out.abs() <= 10.0)
        out.sum().backward()
        assert torch.isfinite(lp.grad).all()
        lp.grad = None
    # masked positions with non-finite inputs are zero and do not poison gradients
    lp2 = torch.tensor([[0.5, float("-inf")]], requires_grad=True)
    out = kl_penalty(lp2, torch.zeros(1, 2), "k3", mask=torch.tensor([[1.0, 0.0]]))
    out.sum().backward()
    assert out[0, 1].item() == 0 and torch.isfinite(lp2.grad).all()
    with pytest.raises(ValueError):
        kl_penalty(lp, rlp, "k4")


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    c.update(10.0, 100)
    assert c.value == 0.05
    c2 = FixedKLController(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


def test_adaptive_kl_controller_vs_reference_and_resume():
    kls = [0.5, 12.0, 6.0, 5.9, 0.0, 7.0, 3.0]
    steps = [64, 128, 64, 32, 256, 64, 64]
    init, target, horizon = 0.2, 6.0, 10000.0
    ref = []
    beta = init
    for kl, n in zip(kls, steps):
        err = kl / target - 1.0
        if err > 0.2:
            err = 0.2
        if err < -0.2:
            err = -0.2
        beta = beta * (1.0 + err * n / horizon)
        ref.append(beta)
    c = AdaptiveKLController(init, target, horizon)
    got = [c.update(torch.tensor(kl, dtype=D) if i % 2 else kl, n) for i, (kl, n) in enumerate(zip(kls, steps))]
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-12
    # KL twice the target: the proportional error is clipped at +0.2 (and at -0.2 for KL = 0)
    assert got[1] == pytest.approx(got[0] * (1 + 0.2 * 128 / horizon), rel=1e-12)
    assert got[4] == pytest.approx(got[3] * (1 - 0.2 * 256 / horizon), rel=1e-12)
    # exact resume
    a = AdaptiveKLController(init, target, horizon)
    for kl, n in zip(kls[:3], steps[:3]):
        a.update(kl, n)
    b = AdaptiveKLController(1.0, 1.0, 1.0)
    b.load_state_dict(a.state_dict())
    for kl, n in zip(kls[3:], steps[3:]):
        a.update(kl, n)
        b.update(kl, n)
    assert a.value == b.value == pytest.approx(ref[-1], rel=1e-12)


# ----------------------------------------------------------------------------- shaping


def test_last_policy_token_index():
    m = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    idx, has = last_policy_token_index(m)
    assert idx.tolist()[0] == 4 and idx.tolist()[2] == 0
    assert has.tolist() == [True, False, True]


def test_token_level_rewards_vs_reference():
    torch.manual_seed(2)
    B, T = 5, 12
    m = mask_with_holes(B, T)
    s = torch.randn(B, dtype=D)
    kl = torch.randn(B, T, dtype=D)
    kl_nan = torch.where(m != 0, kl, torch.full_like(kl, float("nan")))
    for coef in (0.0, 0.1):
        exp = []
        for b in range(B):
            pos = [t for t in range(T) if m[b, t] != 0]
            row = [(-coef * kl[b, t].item() if m[b, t] != 0 else 0.0) for t in range(T)]
            if pos:
                row[pos[-1]] += s[b].item()
            exp.append(row)
        close(token_level_rewards(s, m, kl_nan, coef), exp)
    out = token_level_rewards(s, m)
    assert torch.all(out[0] == 0)
    assert out[1, T - 4].item() == s[1].item() or m[1, T - 4] == 0
    close(out.sum(1)[1:], s[1:])


def test_overlong_penalty_vs_reference():
    Lmax, buf = 100, 20
    lengths = torch.tensor([0, 50, 80, 81, 90, 99, 100, 101, 500])

    def ref(L, Lmax, buf, f):
        if L <= Lmax - buf:
            return 0.0
        if L <= Lmax:
            return f * ((Lmax - buf) - L) / buf
        return -f

    close(overlong_penalty(lengths, Lmax, buf, 0.5).to(D), [ref(L, Lmax, buf, 0.5) for L in lengths.tolist()], atol=1e-6, rtol=1e-6)
    out = overlong_penalty(lengths, Lmax, buf)
    assert out[6].item() == pytest.approx(-1.0) and out[2].item() == 0.0 and out[4].item() == pytest.approx(-0.5)
    hard = overlong_penalty(lengths, Lmax, 0, 2.0)
    assert hard.tolist() == [0, 0, 0, 0, 0, 0, 0, -2.0, -2.0]


def test_normalize_scores():
    torch.manual_seed(3)
    s = torch.randn(9, dtype=D) * 3 + 1
    close(normalize_scores(s, "none"), s)
    mu, sd = statistics.fmean(s.tolist()), statistics.stdev(s.tolist())
    close(normalize_scores(s, "batch"), [(x - mu) / (sd + 1e-8) for x in s.tolist()])
    clipped = normalize_scores(s, "none", clip=1.5)
    close(clipped, [min(max(x, -1.5), 1.5) for x in s.tolist()])
    assert normalize_scores(s[:1], "batch").item() == 0.0
    with pytest.raises(ValueError):
        normalize_scores(s, "group")


# ----------------------------------------------------------------------------- filters


def test_dynamic_sampling_filter():
    torch.manual_seed(4)
    n = 4
    s = torch.randint(0, 2, (6 * n,)).to(D)
    s[0:n] = 1.0
    s[n:2 * n] = 0.0
    s[2 * n:3 * n] = torch.tensor([0.0, 1.0, 1.0, 1.0])
    keep, dropped = dynamic_sampling_filter(s, n)
    exp_keep, exp_dropped = [], 0
    for g in range(6):
        grp = s[g * n:(g + 1) * n].tolist()
        varied = any(x != grp[0] for x in grp)
        exp_dropped += not varied
        exp_keep += [varied] * n
    assert keep.dtype == torch.bool
    assert keep.tolist() == exp_keep and dropped == exp_dropped
    assert keep[:2 * n].sum() == 0 and keep[2 * n:3 * n].all()
    # group size 1: every group has zero variance
    keep1, d1 = dynamic_sampling_filter(s[:5], 1)
    assert not keep1.any() and d1 == 5
    with pytest.raises(ValueError):
        dynamic_sampling_filter(s[:5], 2)
