"""DPO / IPO / hinge, Bradley-Terry and SFT losses vs. plain-Python references."""

import math

import pytest
import torch

from rlhf.algos.preference import bradley_terry_loss, dpo_loss, sft_loss

from tests.helpers import close

D = torch.float64


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _logps(B=7):
    pc = (-torch.rand(B, dtype=D) * 50 - 10).requires_grad_()
    pr = (-torch.rand(B, dtype=D) * 50 - 10).requires_grad_()
    rc = pc.detach() + torch.randn(B, dtype=D) * 3
    rr = pr.detach() + torch.randn(B, dtype=D) * 3
    return pc, pr, rc, rr


@pytest.mark.parametrize("loss_type,ls,beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.1, 0.5), ("ipo", 0.0, 0.1),
                                               ("hinge", 0.0, 0.2)])
def test_dpo_losses_vs_reference(loss_type, ls, beta):
    torch.manual_seed(0)
    pc, pr, rc, rr = _logps()
    loss, met = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)
    loss.sum().backward()
    exp_l, exp_gc = [], []
    for i in range(7):
        h = (pc[i].item() - pr[i].item()) - (rc[i].item() - rr[i].item())
        if loss_type == "sigmoid":
            exp_l.append(-(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h))
            exp_gc.append(beta * (-(1 - ls) * sigmoid(-beta * h) + ls * sigmoid(beta * h)))
        elif loss_type == "ipo":
            exp_l.append((h - 1 / (2 * beta)) ** 2)
            exp_gc.append(2 * (h - 1 / (2 * beta)))
        else:
            exp_l.append(max(0.0, 1 - beta * h))
            exp_gc.append(-beta if 1 - beta * h > 0 else 0.0)
    close(loss, exp_l)
    close(pc.grad, exp_gc)
    close(pr.grad, [-g for g in exp_gc])
    cr = [beta * (pc[i].item() - rc[i].item()) for i in range(7)]
    rj = [beta * (pr[i].item() - rr[i].item()) for i in range(7)]
    close(met["chosen_reward"], cr)
    close(met["rejected_reward"], rj)
    close(met["margin"], [a - b for a, b in zip(cr, rj)])
    close(met["accuracy"], [float(a > b) for a, b in zip(cr, rj)])


def test_dpo_reference_free_and_validation():
    torch.manual_seed(1)
    pc, pr, _, _ = _logps(4)
    loss, met = dpo_loss(pc, pr, None, None, beta=0.3, reference_free=True)
    close(loss, [-log_sigmoid(0.3 * (pc[i].item() - pr[i].item())) for i in range(4)])
    close(met["chosen_reward"], 0.3 * pc.detach())
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, None, None)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, pc, pr, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, pc, pr, loss_type="kto")
    # at the reference (h = 0) the DPO loss is log 2
    l0, _ = dpo_loss(pc, pr, pc.detach(), pr.detach())
    close(l0, torch.full((4,), math.log(2.0), dtype=D))


def test_bradley_terry_loss():
    torch.manual_seed(2)
    c, r = torch.randn(9, dtype=D), torch.randn(9, dtype=D)
    mg = torch.rand(9, dtype=D)
    for margin in (None, mg):
        loss, acc = bradley_terry_loss(c, r, margin)
        m = [0.0] * 9 if margin is None else margin.tolist()
        close(loss, [-log_sigmoid(c[i].item() - r[i].item() - m[i]) for i in range(9)])
        close(acc, [float(c[i].item() > r[i].item()) for i in range(9)])


def test_sft_loss():
    torch.manual_seed(3)
    B, T, V = 3, 6, 11
    logits = torch.randn(B, T, V, dtype=D).requires_grad_()
    labels = torch.randint(0, V, (B, T))
    lm = torch.ones(B, T, dtype=D)
    lm[:, :2] = 0  # prompt
    lm[2, 4:] = 0  # padding
    labels = torch.where(lm != 0, labels, torch.full_like(labels, -100))
    nll, n = sft_loss(logits, labels, lm)
    exp, cnt = 0.0, 0
    L = logits.detach().tolist()
    for b in range(B):
        for t in range(T):
            if lm[b, t] != 0:
                row = L[b][t]
                mx = max(row)
                lse = mx + math.log(sum(math.exp(u - mx) for u in row))
                exp += lse - row[labels[b, t].item()]
                cnt += 1
    close(nll, torch.tensor(exp, dtype=D))
    assert n.item() == cnt
    nll.backward()
    assert torch.all(logits.grad[lm == 0] == 0)
