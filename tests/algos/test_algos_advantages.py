"""Advantage estimators vs. independent float64 plain-Python references."""

import functools
import math
import statistics

import pytest
import torch

from rlhf.algos.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlhf.algos.registry import ADVANTAGE_ESTIMATORS

from tests import helpers

D = torch.float64


# ----------------------------------------------------------------------------- helpers


def rand_int(lo, hi):
    """uniform integer in [lo, hi] from the torch global RNG"""
    return int(torch.randint(lo, hi + 1, (1,)).item())


def make_mask(B, T, empty_rows=(), tool_spans=True):
    """Response masks: a policy span per row, with tool-token holes and some empty rows."""
    rows = []
    for b in range(B):
        row = [0.0] * T
        if b not in empty_rows:
            start = rand_int(0, max(0, T // 5))
            end = rand_int(start + 1, T)
            for t in range(start, end):
                row[t] = 1.0
            if tool_spans and end - start > 5:
                for _ in range(2):
                    a = rand_int(start + 1, end - 3)
                    ln = rand_int(1, min(3, end - 2 - a))
                    for t in range(a, a + ln):
                        row[t] = 0.0
        rows.append(row)
    return torch.tensor(rows, dtype=D)


def policy_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m != 0]


def ref_gae_explicit(r, v, m, gamma, lam):
    """A_{t_i} = sum_l (gamma*lam)^l delta_{t_{i+l}} over policy positions (O(n^2))."""
    B, T = len(r), len(r[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = policy_positions(m[b])
        deltas = []
        for i, t in enumerate(pos):
            v_next = v[b][pos[i + 1]] if i + 1 < len(pos) else 0.0
            deltas.append(r[b][t] + gamma * v_next - v[b][t])
        for i, t in enumerate(pos):
            a = sum((gamma * lam) ** l * deltas[i + l] for l in range(len(pos) - i))
            adv[b][t] = a
            ret[b][t] = a + v[b][t]
    return adv, ret


def ref_gae_loop(r, v, m, gamma, lam):
    B, T = len(r), len(r[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        a_next, v_next = 0.0, 0.0
        for t in reversed(policy_positions(m[b])):
            a_next = r[b][t] + gamma * v_next - v[b][t] + gamma * lam * a_next
            v_next = v[b][t]
            adv[b][t] = a_next
    return adv


def ref_returns(r, m, gamma):
    B, T = len(r), len(r[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = policy_positions(m[b])
        for i, t in enumerate(pos):
            out[b][t] = sum(gamma ** (j - i) * r[b][pos[j]] for j in range(i, len(pos)))
    return out


def ref_whiten(x, m, eps=1e-8):
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[0])) if m[b][t] != 0]
    mu = sum(vals) / len(vals)
    var = sum((u - mu) ** 2 for u in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    return [[(x[b][t] - mu) / math.sqrt(var + eps) if m[b][t] != 0 else 0.0 for t in range(len(x[0]))] for b in range(len(x))]


def ref_grpo(s, n, normalize_std=True, eps=1e-6):
    out = []
    for g in range(len(s) // n):
        grp = s[g * n:(g + 1) * n]
        if n == 1:
            out += [0.0]
            continue
        mu = statistics.fmean(grp)
        sd = statistics.stdev(grp)
        out += [(x - mu) / (sd + eps) if normalize_std else x - mu for x in grp]
    return out


def ref_rloo(s, n):
    out = []
    for g in range(len(s) // n):
        grp = s[g * n:(g + 1) * n]
        for i, x in enumerate(grp):
            if n == 1:
                out.append(0.0)
            else:
                others = [grp[j] for j in range(n) if j != i]
                out.append(x - sum(others) / len(others))
    return out


def last_pos(mask_row):
    pos = policy_positions(mask_row)
    return pos[-1] if pos else None


def to_t(x):
    return torch.tensor(x, dtype=D)


close = functools.partial(helpers.close, atol=1e-9, rtol=1e-9)


# ----------------------------------------------------------------------------- masked stats


def test_masked_mean_var_whiten_vs_loops():
    torch.manual_seed(0)
    x = torch.randn(5, 11, dtype=D)
    m = make_mask(5, 11, empty_rows=(2,))
    x_nan = torch.where(m != 0, x, torch.full_like(x, float("nan")))
    vals = [x[b, t].item() for b in range(5) for t in range(11) if m[b, t] != 0]
    mu = sum(vals) / len(vals)
    var_b = sum((u - mu) ** 2 for u in vals) / len(vals)
    close(masked_mean(x_nan, m), mu)
    close(masked_var(x_nan, m, unbiased=False), var_b)
    close(masked_var(x_nan, m, unbiased=True), var_b * len(vals) / (len(vals) - 1))
    # per-row mean, empty row -> 0
    rows = []
    for b in range(5):
        v = [x[b, t].item() for t in range(11) if m[b, t] != 0]
        rows.append(sum(v) / len(v) if v else 0.0)
    close(masked_mean(x_nan, m, dim=1), rows)
    close(masked_whiten(x_nan, m), ref_whiten(x.tolist(), m.tolist()))
    # shift_mean=False keeps the mean: y = (x - mu)/sd + mu on masked positions
    sd = math.sqrt(var_b * len(vals) / (len(vals) - 1) + 1e-8)
    exp = [[(x[b, t].item() - mu) / sd + mu if m[b, t] != 0 else 0.0 for t in range(11)] for b in range(5)]
    close(masked_whiten(x, m, shift_mean=False), exp)


def test_masked_stats_degenerate():
    x = torch.randn(2, 3, dtype=D)
    empty = torch.zeros(2, 3, dtype=D)
    assert masked_mean(x, empty).item() == 0.0
    assert masked_var(x, empty).item() == 0.0
    one = torch.zeros(2, 3, dtype=D)
    one[1, 2] = 1
    assert masked_var(x, one, unbiased=True).item() == 0.0
    close(masked_mean(x, one), x[1, 2])
    assert torch.all(masked_whiten(x, one) == 0)
    # bool masks behave like float masks
    mb = torch.rand(2, 3) > 0.3
    mb[0, 0] = True
    close(masked_mean(x, mb), masked_mean(x, mb.to(D)))


# ----------------------------------------------------------------------------- GAE


def test_gae_matches_explicit_sum_reference():
    torch.manual_seed(1)
    B, T = 6, 37
    r, v = torch.randn(B, T, dtype=D), torch.randn(B, T, dtype=D)
    m = make_mask(B, T, empty_rows=(4,))
    for gamma, lam in [(0.9, 0.8), (1.0, 0.95), (0.99, 0.0), (0.5, 1.0)]:
        adv, ret = gae(r, v, m, gamma, lam)
        ra, rr = ref_gae_explicit(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
        close(adv, ra)
        close(ret, rr)
    assert torch.all(adv[4] == 0) and torch.all(ret[4] == 0)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)


def test_gae_long_sequence():
    torch.manual_seed(2)
    B, T = 3, 4096
    r, v = torch.randn(B, T, dtype=D) * 0.1, torch.randn(B, T, dtype=D)
    m = make_mask(B, T)
    adv, ret = gae(r, v, m, 0.999, 0.97)
    ra = ref_gae_loop(r.tolist(), v.tolist(), m.tolist(), 0.999, 0.97)
    close(adv, ra, atol=1e-8, rtol=1e-8)
    close(ret, torch.where(m != 0, to_t(ra) + v, torch.zeros_like(v)), atol=1e-8, rtol=1e-8)


def test_gae_lambda1_gamma1_is_returns_minus_values():
    torch.manual_seed(3)
    B, T = 4, 29
    r, v = torch.randn(B, T, dtype=D), torch.randn(B, T, dtype=D)
    m = make_mask(B, T, empty_rows=(0,))
    adv, ret = gae(r, v, m, 1.0, 1.0)
    rtg = ref_returns(r.tolist(), m.tolist(), 1.0)
    close(adv, torch.where(m != 0, to_t(rtg) - v, torch.zeros_like(v)))
    close(ret, rtg)


def test_gae_ignores_masked_values_and_skips_tool_tokens():
    torch.manual_seed(4)
    T = 20
    m = torch.ones(1, T, dtype=D)
    m[0, 5:9] = 0  # tool output in the middle
    m[0, 15:] = 0  # padding
    r, v = torch.randn(1, T, dtype=D), torch.randn(1, T, dtype=D)
    r_bad = torch.where(m != 0, r, torch.full_like(r, float("nan")))
    v_bad = torch.where(m != 0, v, torch.full_like(v, float("inf")))
    adv, ret = gae(r_bad, v_bad, m, 0.9, 0.7)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # same as the sequence with the tool tokens removed
    keep = m[0] != 0
    adv_c, ret_c = gae(r[:, keep], v[:, keep], torch.ones(1, int(keep.sum()), dtype=D), 0.9, 0.7)
    close(adv[:, keep], adv_c)
    close(ret[:, keep], ret_c)


# ----------------------------------------------------------------------------- outcome estimators


@pytest.mark.parametrize("n", [1, 2, 5])
def test_grpo_matches_reference_and_properties(n):
    torch.manual_seed(5)
    G = 4
    s = torch.randn(G * n, dtype=D)
    if n > 1:
        s[n:2 * n] = 0.7  # a group of equal rewards
    for norm in (True, False):
        a = grpo_advantages(s, n, normalize_std=norm)
        close(a, ref_grpo(s.tolist(), n, norm))
    a = grpo_advantages(s, n).view(G, n)
    if n == 1:
        assert torch.all(a == 0)
        return
    close(a.mean(dim=1), torch.zeros(G, dtype=D), atol=1e-12, rtol=0)
    assert torch.all(a[1] == 0)
    for g in (0, 2, 3):
        sd = statistics.stdev(s[g * n:(g + 1) * n].tolist())
        close(a[g].std(unbiased=True), torch.tensor(sd / (sd + 1e-6), dtype=D))
    # eps=0: exactly unit std, and the equal-reward group is still 0 (not NaN)
    a0 = grpo_advantages(s, n, eps=0.0).view(G, n)
    assert torch.all(a0[1] == 0)
    for g in (0, 2, 3):
        close(a0[g].std(unbiased=True), torch.tensor(1.0, dtype=D))


def test_dr_grpo_is_mean_centred():
    torch.manual_seed(6)
    n, G = 4, 3
    s = torch.rand(G * n, dtype=D)
    a = dr_grpo_advantages(s, n)
    close(a, ref_grpo(s.tolist(), n, normalize_std=False))
    close(a.view(G, n).mean(1), torch.zeros(G, dtype=D), atol=1e-12, rtol=0)
    # shifting a group's scores does not change it, scaling scales it (no std)
    close(dr_grpo_advantages(s + 3.0, n), a)
    close(dr_grpo_advantages(s * 2.0, n), 2.0 * a)
    assert torch.all(dr_grpo_advantages(s[:3], 1) == 0)


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_rloo_matches_reference(n):
    torch.manual_seed(7)
    s = torch.randn(3 * n, dtype=D)
    close(rloo_advantages(s, n), ref_rloo(s.tolist(), n))


def test_rloo_baseline_excludes_self():
    torch.manual_seed(8)
    n = 5
    s = torch.randn(2 * n, dtype=D)
    a0 = rloo_advantages(s, n)
    s2 = s.clone()
    s2[1] += 2.5
    a1 = rloo_advantages(s2, n)
    d = a1 - a0
    # own advantage moves by exactly the perturbation (baseline does not depend on itself)
    close(d[1], torch.tensor(2.5, dtype=D))
    # the others' baselines move by 2.5 / (n-1); the other group is untouched
    for j in (0, 2, 3, 4):
        close(d[j], torch.tensor(-2.5 / (n - 1), dtype=D))
    close(d[n:], torch.zeros(n, dtype=D))
    # equal rewards -> 0
    assert torch.all(rloo_advantages(torch.full((4,), 0.3, dtype=D), 4) == 0)


def test_bad_group_size_raises():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(4), 0)


def test_broadcast_to_tokens():
    torch.manual_seed(9)
    m = make_mask(4, 9, empty_rows=(1,))
    a = torch.randn(4, dtype=D)
    exp = [[a[b].item() if m[b, t] != 0 else 0.0 for t in range(9)] for b in range(4)]
    close(broadcast_to_tokens(a, m), exp)


# ----------------------------------------------------------------------------- REINFORCE++


def test_discounted_returns_vs_reference():
    torch.manual_seed(10)
    r = torch.randn(5, 23, dtype=D)
    m = make_mask(5, 23, empty_rows=(3,))
    close(discounted_returns(r, m, 0.95), ref_returns(r.tolist(), m.tolist(), 0.95))


def test_reinforce_pp_vs_reference_and_whitened():
    torch.manual_seed(11)
    B, T = 6, 31
    r = torch.randn(B, T, dtype=D)
    m = make_mask(B, T, empty_rows=(5,))
    for gamma in (1.0, 0.9):
        a = reinforce_pp_advantages(r, m, gamma)
        close(a, ref_whiten(ref_returns(r.tolist(), m.tolist(), gamma), m.tolist()))
    vals = a[m != 0]
    assert abs(vals.mean().item()) < 1e-10
    assert abs(vals.std(unbiased=True).item() - 1.0) < 1e-6
    assert torch.all(a[m == 0] == 0)


def test_reinforce_pp_baseline_vs_reference():
    torch.manual_seed(12)
    n, G, T = 3, 3, 17
    B = n * G
    s = torch.randn(B, dtype=D)
    kl_r = -0.05 * torch.rand(B, T, dtype=D)
    m = make_mask(B, T, empty_rows=(4,))
    ml = m.tolist()
    for gamma, tr in [(1.0, kl_r), (0.97, kl_r), (1.0, None)]:
        # reference: centre within group, put at last policy token, add per-token rewards
        rew = [[(tr[b, t].item() if tr is not None else 0.0) for t in range(T)] for b in range(B)]
        for b in range(B):
            g = b // n
            grp = s[g * n:(g + 1) * n].tolist()
            lp = last_pos(ml[b])
            if lp is not None:
                rew[b][lp] += s[b].item() - sum(grp) / n
        exp = ref_whiten(ref_returns(rew, ml, gamma), ml)
        close(reinforce_pp_baseline_advantages(s, tr, m, n, gamma), exp)


# ----------------------------------------------------------------------------- dispatcher


def test_compute_advantages_all_estimators():
    torch.manual_seed(13)
    n, G, T = 4, 2, 19
    B = n * G
    s = torch.randint(0, 2, (B,)).to(D)
    kl_r = -0.01 * torch.rand(B, T, dtype=D)
    v = torch.randn(B, T, dtype=D)
    m = make_mask(B, T, empty_rows=(6,))
    ml = m.tolist()
    full = [[kl_r[b, t].item() for t in range(T)] for b in range(B)]
    for b in range(B):
        lp = last_pos(ml[b])
        if lp is not None:
            full[b][lp] += s[b].item()
    s_tot = [s[b].item() + sum(kl_r[b, t].item() for t in range(T) if ml[b][t] != 0) for b in range(B)]

    def bc(seq):
        return [[seq[b] if ml[b][t] != 0 else 0.0 for t in range(T)] for b in range(B)]

    kw = dict(scores=s, token_rewards=kl_r, values=v, mask=m, group_size=n, gamma=0.98, lam=0.9)
    seen = set()
    for est in ADVANTAGE_ESTIMATORS.builtin_names():
        adv, ret = compute_advantages(est, **kw)
        seen.add(est)
        assert adv.shape == (B, T)
        if est == "gae":
            ea, er = ref_gae_explicit(full, v.tolist(), ml, 0.98, 0.9)
            close(adv, ea)
            close(ret, er)
            continue
        assert ret is None
        if est == "grpo":
            close(adv, bc(ref_grpo(s_tot, n)))
        elif est == "dr_grpo":
            close(adv, bc(ref_grpo(s_tot, n, normalize_std=False)))
        elif est == "rloo":
            close(adv, bc(ref_rloo(s_tot, n)))
        elif est == "reinforce_pp":
            close(adv, ref_whiten(ref_returns(full, ml, 0.98), ml))
        elif est == "reinforce_pp_baseline":
            close(adv, reinforce_pp_baseline_advantages(s, kl_r, m, n, 0.98))
        elif est == "distill":  # the per-token rewards as they are, the scores unused
            close(adv, [[kl_r[b, t].item() if ml[b][t] != 0 else 0.0 for t in range(T)] for b in range(B)])
    assert seen == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "distill"}
    # normalize_std=False turns grpo into dr_grpo
    a1, _ = compute_advantages("grpo", scores=s, mask=m, group_size=n, normalize_std=False)
    a2, _ = compute_advantages("dr_grpo", scores=s, mask=m, group_size=n)
    close(a1, a2)
    # token rewards that already contain the score: pass scores=None
    a3, _ = compute_advantages("reinforce_pp", token_rewards=to_t(full), mask=m)
    close(a3, ref_whiten(ref_returns(full, ml, 1.0), ml))
    with pytest.raises(ValueError):
        compute_advantages("ppo", scores=s, mask=m)
    with pytest.raises(ValueError):
        compute_advantages("gae", scores=s, mask=m)
