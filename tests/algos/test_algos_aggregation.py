"""Loss aggregation: whole batch == gradient accumulation over micro-batches ==
simulated data parallel with gradient averaging, for every mode."""

import copy
import functools

import pytest
import torch

from rlhf.algos.losses import (
    aggregate,
    aggregation_denominator,
    micro_batch_loss,
    policy_loss,
    token_logprobs,
    value_loss,
)
from rlhf.algos.registry import LOSS_AGGREGATIONS

from tests import helpers

D = torch.float64
B, T, DIM, V = 11, 16, 6, 9

close = functools.partial(helpers.close, atol=1e-12, rtol=1e-10)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, DIM, generator=g, dtype=D)
    tok = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g, dtype=D) * 2 - 1.5
    adv = torch.randn(B, T, generator=g, dtype=D)
    ret = torch.randn(B, T, generator=g, dtype=D)
    m = torch.zeros(B, T, dtype=D)
    lengths = [16, 3, 9, 0, 12, 1, 16, 7, 5, 0, 14]  # varied lengths, two all-masked rows
    for b, L in enumerate(lengths):
        m[b, :L] = 1
    m[0, 4:7] = 0  # tool tokens in the middle
    m[6, 10:12] = 0
    return dict(x=x, tok=tok, old=old, adv=adv, ret=ret, m=m)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(123)
        self.body = torch.nn.Linear(DIM, V, dtype=D)
        self.value_head = torch.nn.Linear(DIM, 1, dtype=D)

    def per_token(self, batch):
        lp = token_logprobs(self.body(batch["x"]), batch["tok"])
        pl, _ = policy_loss(lp, batch["old"], batch["adv"], batch["m"], clip_low=0.2, clip_high=0.28)
        vals = self.value_head(batch["x"]).squeeze(-1)
        vl = value_loss(vals, batch["ret"] + 0.1, batch["ret"], batch["m"])
        return pl + 0.5 * vl


def rows(batch, lo, hi, trim=True):
    """rows lo..hi-1, right-trimmed to their own longest policy span (ragged widths)"""
    sub = {k: v[lo:hi] for k, v in batch.items()}
    if trim:
        cols = (sub["m"] != 0).any(0).nonzero()
        w = int(cols.max()) + 1 if len(cols) else 1
        sub = {k: v[:, :w] for k, v in sub.items()}
    return sub


def ref_aggregate(pt, m, mode, L):
    """plain-Python reference of each aggregation mode"""
    pt, m = pt.tolist(), m.tolist()
    row_sums, row_n = [], []
    for b in range(len(pt)):
        s = n = 0
        for t in range(len(pt[0])):
            if m[b][t] != 0:
                s += pt[b][t]
                n += 1
        row_sums.append(s)
        row_n.append(n)
    nonempty = [b for b in range(len(pt)) if row_n[b] > 0]
    if mode == "token_mean":
        return sum(row_sums) / sum(row_n)
    if mode == "seq_mean_token_sum":
        return sum(row_sums[b] for b in nonempty) / len(nonempty)
    if mode == "seq_mean_token_mean":
        return sum(row_sums[b] / row_n[b] for b in nonempty) / len(nonempty)
    if mode == "seq_mean_token_sum_norm":
        return sum(row_sums[b] for b in nonempty) / L / len(nonempty)
    raise AssertionError(mode)


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


SPLITS = [(0, 3), (3, 4), (4, 8), (8, 11)]


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_whole_batch_matches_reference(mode):
    batch = make_batch()
    model = Model()
    pt = model.per_token(batch)
    loss = aggregate(pt, batch["m"], mode, aggregation_denominator(batch["m"], mode, max_response_length=T))
    close(loss, torch.tensor(ref_aggregate(pt.detach(), batch["m"], mode, T), dtype=D))
    # denominator=None means "this batch is the whole batch"
    close(aggregate(pt, batch["m"], mode), loss)


def test_denominators():
    m = make_batch()["m"]
    n_tok = int((m != 0).sum())
    assert aggregation_denominator(m, "token_mean") == n_tok
    assert aggregation_denominator(m, "seq_mean_token_sum") == 9  # 11 rows, 2 empty
    assert aggregation_denominator(m, "seq_mean_token_mean") == 9
    assert aggregation_denominator(m, "seq_mean_token_sum_norm") == 9 * T
    assert aggregation_denominator(m, "seq_mean_token_sum_norm", max_response_length=100) == 900
    # additive over shards / lists of micro-batch masks
    parts = [rows({"m": m}, lo, hi)["m"] for lo, hi in SPLITS]
    for mode in LOSS_AGGREGATIONS:
        whole = aggregation_denominator(m, mode, max_response_length=T)
        assert aggregation_denominator(parts, mode, max_response_length=T) == whole
        assert sum(aggregation_denominator(p, mode, max_response_length=T) for p in parts) == whole
    # empty batch -> zero loss, not NaN
    z = aggregate(torch.ones(2, 3, dtype=D), torch.zeros(2, 3, dtype=D), "token_mean")
    assert z.item() == 0.0
    with pytest.raises(ValueError):
        aggregation_denominator(m, "sum")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_gradient_accumulation_equals_whole_batch(mode):
    batch = make_batch()
    whole_model, acc_model = Model(), Model()
    den = aggregation_denominator(batch["m"], mode, max_response_length=T)
    whole = aggregate(whole_model.per_token(batch), batch["m"], mode, den)
    whole.backward()

    mbs = [rows(batch, lo, hi) for lo, hi in SPLITS]
    assert len({mb["m"].shape[1] for mb in mbs}) > 1  # ragged micro-batch widths
    den_mb = aggregation_denominator([mb["m"] for mb in mbs], mode, max_response_length=T)
    assert den_mb == den
    total = 0.0
    for mb in mbs:
        loss = micro_batch_loss(acc_model.per_token(mb), mb["m"], mode, den_mb)
        loss.backward()
        total = total + loss.detach()
    close(total, whole.detach())
    for g1, g2 in zip(grads(whole_model), grads(acc_model)):
        close(g1, g2)

    if mode == "token_mean":
        # sanity: the naive "mean of per-micro-batch means" is NOT the whole-batch loss
        naive = sum(aggregate(acc_model.per_token(mb), mb["m"], mode).detach() for mb in mbs) / len(mbs)
        assert abs(naive.item() - whole.item()) > 1e-6


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_with_grad_averaging_equals_whole_batch(mode, world):
    batch = make_batch(seed=1)
    ref_model = Model()
    whole = aggregate(ref_model.per_token(batch), batch["m"], mode,
                      aggregation_denominator(batch["m"], mode, max_response_length=T))
    whole.backward()

    # uneven shards per rank, each processed in micro-batches of 2 rows
    bounds = {2: [(0, 6), (6, 11)], 3: [(0, 4), (4, 5), (5, 11)]}[world]
    init = Model()
    ranks = [copy.deepcopy(init) for _ in range(world)]
    shards = [rows(batch, lo, hi, trim=False) for lo, hi in bounds]
    # all-reduce(SUM) of the local denominators
    den = sum(aggregation_denominator(s["m"], mode, max_response_length=T) for s in shards)
    logged = []
    for model, shard in zip(ranks, shards):
        rank_sum = 0.0
        for lo in range(0, shard["m"].shape[0], 2):
            mb = rows(shard, lo, min(lo + 2, shard["m"].shape[0]))
            loss = micro_batch_loss(model.per_token(mb), mb["m"], mode, den, dp_world_size=world)
            loss.backward()
            rank_sum = rank_sum + loss.detach()
        logged.append(rank_sum)
    # DDP / DeepSpeed average the gradients over ranks
    avg = [sum(gs) / world for gs in zip(*[grads(mdl) for mdl in ranks])]
    for g_ref, g_dp in zip(grads(ref_model), avg):
        close(g_ref, g_dp)
    close(sum(logged) / world, whole.detach())
