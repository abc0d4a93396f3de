"""Policy/value losses, log-probs and entropy vs. plain-Python float64 references."""

import math

import pytest
import torch

import rlhf.algos.losses as losses_mod
from rlhf.algos.losses import entropy_from_logits, policy_loss, token_logprobs, value_loss

from tests.helpers import close

D = torch.float64


def make_mask(B, T):
    m = torch.zeros(B, T, dtype=D)
    for b in range(B):
        end = int(torch.randint(2, T + 1, (1,)))
        m[b, :end] = 1
        if end > 6:  # a block of tool tokens in the middle
            a = int(torch.randint(1, end - 3, (1,)))
            m[b, a:a + 2] = 0
    m[-1] = 0  # an all-masked row
    return m


# ----------------------------------------------------------------------------- log-probs / entropy


def ref_logsoftmax_row(row, tau):
    z = [x / tau for x in row]
    mx = max(z)
    lse = mx + math.log(sum(math.exp(u - mx) for u in z))
    return [u - lse for u in z]


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_token_logprobs_values_and_grad(tau, monkeypatch):
    torch.manual_seed(0)
    B, T, V = 3, 5, 13
    logits = (torch.randn(B, T, V, dtype=D) * 3).requires_grad_()
    tok = torch.randint(0, V, (B, T))
    up = torch.randn(B, T, dtype=D)
    monkeypatch.setattr(losses_mod, "_CHUNK_ELEMENTS", 2 * V)  # force several chunks
    lp = token_logprobs(logits, tok, temperature=tau)
    (lp * up).sum().backward()
    exp_lp, exp_grad = [], []
    L = logits.detach().tolist()
    for b in range(B):
        rl, rg = [], []
        for t in range(T):
            ls = ref_logsoftmax_row(L[b][t], tau)
            y = tok[b, t].item()
            rl.append(ls[y])
            rg.append([up[b, t].item() * ((1.0 if v == y else 0.0) - math.exp(ls[v])) / tau for v in range(V)])
        exp_lp.append(rl)
        exp_grad.append(rg)
    close(lp, exp_lp)
    close(logits.grad, exp_grad)


def test_token_logprobs_low_precision():
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 50) * 4).to(torch.bfloat16).requires_grad_()
    tok = torch.randint(0, 50, (2, 4))
    lp = token_logprobs(logits, tok)
    assert lp.dtype == torch.float32
    ref = torch.log_softmax(logits.detach().to(D), -1).gather(-1, tok[..., None])[..., 0]
    close(lp.to(D), ref, atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_entropy_from_logits():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 7, dtype=D) * 2
    exp = []
    for b in range(2):
        row = []
        for t in range(3):
            ls = ref_logsoftmax_row(logits[b, t].tolist(), 1.0)
            row.append(-sum(math.exp(u) * u for u in ls))
        exp.append(row)
    close(entropy_from_logits(logits), exp)
    close(entropy_from_logits(torch.zeros(1, 1, 7, dtype=D)), [[math.log(7)]])
    assert entropy_from_logits(torch.tensor([[[0.0, -1e4, -1e4]]], dtype=D)).abs().item() < 1e-10


# ----------------------------------------------------------------------------- policy loss


def ref_policy(lp, olp, A, m, cl, ch, dual=None, level="token", rlp=None, cap=None):
    """returns per-token loss, d(loss_t)/d(logp_t), stats (all plain python)."""
    B, T = len(lp), len(lp[0])
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    n = n_clip = n_low = n_high = n_dual = 0
    kl_sum = ratio_sum = w_sum = 0.0
    for b in range(B):
        pos = [t for t in range(T) if m[b][t] != 0]
        if level == "sequence" and pos:
            s_b = math.exp(sum(lp[b][t] - olp[b][t] for t in pos) / len(pos))
        for t in pos:
            tr = math.exp(lp[b][t] - olp[b][t])
            r = s_b if level == "sequence" else tr
            a = A[b][t]
            unclipped = -a * r
            clipped = -a * min(max(r, 1 - cl), 1 + ch)
            l = max(unclipped, clipped)
            g = -a * r if unclipped >= clipped else 0.0  # d(-a*r)/dlogp = -a*r in both cases
            n += 1
            n_clip += clipped > unclipped
            n_low += a < 0 and r < 1 - cl
            n_high += a > 0 and r > 1 + ch
            if dual is not None and a < 0 and -dual * a < l:
                l, g = -dual * a, 0.0
                n_dual += 1
            if rlp is not None:
                w = math.exp(olp[b][t] - rlp[b][t])
                if cap is not None:
                    w = min(w, cap)
                l, g = l * w, g * w
                w_sum += w
            loss[b][t], grad[b][t] = l, g
            kl_sum += tr - 1 - math.log(tr)
            ratio_sum += r
    stats = {"clip_frac": n_clip / n, "clip_frac_low": n_low / n, "clip_frac_high": n_high / n,
             "approx_kl": kl_sum / n, "ratio_mean": ratio_sum / n}
    if dual is not None:
        stats["dual_clip_frac"] = n_dual / n
    if rlp is not None:
        stats["tis_weight_mean"] = w_sum / n
    return loss, grad, stats


def _inputs(B, T, spread=0.3):
    olp = -torch.rand(B, T, dtype=D) * 2
    lp = (olp + spread * torch.randn(B, T, dtype=D)).requires_grad_()
    A = torch.randn(B, T, dtype=D)
    m = make_mask(B, T)
    return lp, olp, A, m


CONFIGS = [
    dict(clip_low=0.2, clip_high=0.2),
    dict(clip_low=0.2, clip_high=0.28),  # DAPO clip-higher
    dict(clip_low=0.1, clip_high=0.3, dual_clip=3.0),
    dict(clip_low=0.2, clip_high=0.2, ratio_level="sequence"),
    dict(clip_low=0.2, clip_high=0.3, dual_clip=1.5, tis=2.0),
    dict(clip_low=0.2, clip_high=0.2, tis=None),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_policy_loss_vs_reference(cfg):
    torch.manual_seed(3)
    B, T = 5, 24
    lp, olp, A, m = _inputs(B, T, spread=0.6)
    with torch.no_grad():  # make sure every branch is hit: a ratio e^1.5 > c with A < 0
        lp[0, 0] = olp[0, 0] + 1.5
        A[0, 0] = -1.0
    cfg = dict(cfg)
    use_tis = "tis" in cfg
    cap = cfg.pop("tis", None)
    rlp = (olp + 0.5 * torch.randn(B, T, dtype=D)) if use_tis else None
    # garbage at masked positions must not matter
    lp_in = torch.where(m != 0, lp, torch.full_like(lp, 1e6))
    loss, stats = policy_loss(lp_in, olp, A, m, rollout_logp=rlp, tis_cap=cap, **cfg)
    loss.sum().backward()
    rl, rg, rs = ref_policy(lp.tolist(), olp.tolist(), A.tolist(), m.tolist(), cfg["clip_low"], cfg["clip_high"],
                            cfg.get("dual_clip"), cfg.get("ratio_level", "token"),
                            rlp.tolist() if rlp is not None else None, cap)
    close(loss, rl)
    close(lp.grad, rg)
    assert torch.all(loss[m == 0] == 0)
    for k, v in rs.items():
        close(stats[k], torch.tensor(v, dtype=D))
        assert not stats[k].requires_grad
    assert rs["clip_frac"] > 0  # the test inputs do exercise clipping
    if cfg.get("dual_clip"):
        assert rs["dual_clip_frac"] > 0
    if use_tis:
        assert "tis_weight_mean" in stats


def test_policy_loss_long_sequence():
    torch.manual_seed(4)
    B, T = 2, 4096
    lp, olp, A, m = _inputs(B, T, spread=0.2)
    for level in ("token", "sequence"):
        lp.grad = None
        loss, stats = policy_loss(lp, olp, A, m, clip_low=0.2, clip_high=0.25, ratio_level=level)
        loss.sum().backward()
        rl, rg, rs = ref_policy(lp.tolist(), olp.tolist(), A.tolist(), m.tolist(), 0.2, 0.25, level=level)
        close(loss, rl, atol=1e-9, rtol=1e-9)
        close(lp.grad, rg, atol=1e-9, rtol=1e-9)
        close(stats["clip_frac"], torch.tensor(rs["clip_frac"], dtype=D))


def test_gspo_token_matches_sequence_objective_gradient():
    """With sequence-constant advantages and seq_mean_token_mean aggregation, GSPO-token
    has the gradient of GSPO's sequence objective mean_i max(-A_i s_i, -A_i clip(s_i))."""
    torch.manual_seed(5)
    B, T = 6, 15
    lp, olp, _, m = _inputs(B, T, spread=0.05)
    A_seq = torch.randn(B, dtype=D)
    A = A_seq[:, None].expand(B, T)
    eps_l, eps_h = 0.01, 0.012
    loss, _ = policy_loss(lp, olp, A, m, clip_low=eps_l, clip_high=eps_h, ratio_level="sequence")
    agg = losses_mod.aggregate(loss, m, "seq_mean_token_mean")
    g1, = torch.autograd.grad(agg, lp)
    # independent sequence-level objective (full gradient through s_i)
    lp2 = lp.detach().clone().requires_grad_()
    terms = []
    for b in range(B):
        idx = (m[b] != 0).nonzero().flatten()
        if len(idx) == 0:
            continue
        s = torch.exp((lp2[b, idx] - olp[b, idx]).mean())
        terms.append(torch.maximum(-A_seq[b] * s, -A_seq[b] * s.clamp(1 - eps_l, 1 + eps_h)))
    J = torch.stack(terms).mean()
    g2, = torch.autograd.grad(J, lp2)
    close(agg, J)
    close(g1, g2)
    assert g1.abs().sum() > 0


def test_policy_loss_extreme_ratios_are_finite_and_validate_args():
    lp = torch.tensor([[50.0, -50.0, 0.0]], requires_grad=True)
    olp = torch.zeros(1, 3)
    A = torch.tensor([[-1.0, 1.0, 1.0]])
    m = torch.ones(1, 3)
    loss, stats = policy_loss(lp, olp, A, m, dual_clip=3.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert loss[0, 0].item() == pytest.approx(3.0)  # dual clip bound -c*A
    with pytest.raises(ValueError):
        policy_loss(lp, olp, A, m, dual_clip=0.5)
    with pytest.raises(ValueError):
        policy_loss(lp, olp, A, m, ratio_level="seq")


def test_tis_weight_is_detached_and_capped():
    torch.manual_seed(6)
    lp, olp, A, m = _inputs(3, 8)
    rlp = (olp - 2.0).requires_grad_()  # weights exp(2) > cap
    loss, stats = policy_loss(lp, olp, A, m, rollout_logp=rlp, tis_cap=1.5)
    base, _ = policy_loss(lp, olp, A, m)
    close(loss, 1.5 * base)
    close(stats["tis_weight_mean"], torch.tensor(1.5, dtype=D))
    close(stats["tis_capped_frac"], torch.tensor(1.0, dtype=D))
    loss.sum().backward()
    assert rlp.grad is None


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_vs_reference(clip):
    torch.manual_seed(7)
    B, T = 4, 10
    old = torch.randn(B, T, dtype=D)
    v = (old + 0.4 * torch.randn(B, T, dtype=D)).requires_grad_()
    R = torch.randn(B, T, dtype=D)
    m = make_mask(B, T)
    out = value_loss(v, old, R, m, clip=clip)
    exp = []
    for b in range(B):
        row = []
        for t in range(T):
            if m[b, t] == 0:
                row.append(0.0)
                continue
            vv, o, r = v[b, t].item(), old[b, t].item(), R[b, t].item()
            e1 = (vv - r) ** 2
            if clip is None:
                row.append(0.5 * e1)
            else:
                vc = o + min(max(vv - o, -clip), clip)
                row.append(0.5 * max(e1, (vc - r) ** 2))
        exp.append(row)
    close(out, exp)
    out.sum().backward()
    assert torch.all(v.grad[m == 0] == 0)
