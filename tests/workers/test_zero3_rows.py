"""Under ZeRO-3 every rank must call the LM head as often as the others (each call gathers the
partitioned weight). rlhf.workers.zero3.equal_head_rows pads a rank's rows to the largest count;
checked on two gloo ranks with a head whose weight carries ZeRO-3's ``ds_id`` mark: equal head
calls, and the same log-probs and weight gradient as without padding; and a policy worker's
packed passes, whose counts are agreed once per call (``packed_micro_batches``); and the supervised
objectives' passes, whose counts the driver writes into each micro-batch (``agree_head_rows``)."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.algos import logprobs_from_hidden
from rlhf.workers.zero3 import equal_head_rows


@contextlib.contextmanager
def counting_all_reduces():
    """The element counts of every ``dist.all_reduce`` while inside, in a list (the calls go through)."""
    reduces: list[int] = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        reduces.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    try:
        yield reduces
    finally:
        dist.all_reduce = real


class _CountingHead(torch.nn.Linear):
    """A bias-free linear head that counts its calls (not a plain nn.Linear: the chunked path calls it)."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out[("worker", rank)] = _worker_checks(rank)
        out[("supervised", rank)] = _supervised_checks(rank)
        torch.manual_seed(0)
        head = _CountingHead(8, 50, bias=False).double()
        head.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
        n = (3, 11)[rank]
        g = torch.Generator().manual_seed(rank)
        hidden = torch.randn(n, 8, dtype=torch.float64, generator=g, requires_grad=True)
        tokens = torch.randint(0, 50, (n,), generator=g)
        h, y, keep = equal_head_rows(hidden, tokens, head)
        lp, _ = logprobs_from_hidden(h, head, y, vocab=50, chunk_elements=4 * 50)  # 4 rows per head call
        lp[:keep].sum().backward()
        padded = (h.shape[0], keep, _CountingHead.calls, lp[:keep].detach().clone(), head.weight.grad.clone())
        head.weight.grad = None
        ref, _ = logprobs_from_hidden(hidden, head, tokens, vocab=50, chunk_elements=4 * 50)
        ref.sum().backward()
        out[rank] = (*padded, ref.detach(), head.weight.grad.clone())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """What both gloo ranks measured, from one spawn for the module's tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    return dict(out)


def test_ranks_call_a_zero3_head_equally_and_padding_changes_nothing(two_ranks):
    out = two_ranks
    rows = [out[r][0] for r in range(2)]
    calls = [out[r][2] for r in range(2)]
    # ceil(11 / 4) = 3 chunks on both ranks, each called in the forward and again in the backward
    assert rows == [11, 11] and calls[0] == calls[1] == 6
    for r in range(2):
        _, keep, _, lp, grad, ref_lp, ref_grad = out[r]
        assert keep == (3, 11)[r]
        assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(grad, ref_grad, atol=1e-12)


def test_without_zero3_nothing_is_padded():
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, tokens = torch.randn(3, 8), torch.randint(0, 50, (3,))
    h, y, n = equal_head_rows(hidden, tokens, head)
    assert h is hidden and y is tokens and n == 3


def _worker_checks(rank: int) -> tuple:
    """A policy worker's packed log-prob pass on two gloo ranks with different batches, its LM head
    marked as ZeRO-3's: the head row counts are agreed once per call, not once per head pass."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.data.batch import collate
    from rlhf.models.varlen import use_varlen
    from rlhf.workers.policy import PolicyWorker

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).double().eval()
    use_varlen(model)
    model.lm_head.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    worker = PolicyWorker.__new__(PolicyWorker)  # the methods under test, without Ray or DeepSpeed
    worker.module, worker.world_size, worker.device, worker.temperature = model, 2, "cpu", 1.0
    worker.spec = SimpleNamespace(train=SimpleNamespace(max_tokens_per_micro_batch=12, compile_logprobs=False))
    g = torch.Generator().manual_seed(rank)
    n_rows = (2, 5)[rank]  # rank 0 runs stand-ins for the micro-batches it lacks
    prompts = [torch.randint(1, 50, (3,), generator=g).tolist() for _ in range(n_rows)]
    responses = [torch.randint(1, 50, (1 + (i * 3 + rank) % 5,), generator=g).tolist() for i in range(n_rows)]
    batch = collate(prompts, responses, 0)

    with counting_all_reduces() as reduces:
        packed = worker.packed_micro_batches(batch)
        agreed = list(reduces)
        reduces.clear()
        with torch.no_grad():
            got = [worker._token_logprobs(model, p if rows else worker._stand_in(p))[0] for rows, p in packed]
            passes = list(reduces)
            reduces.clear()  # and the same passes without the agreed counts: each agrees its own
            alone = [worker._token_logprobs(model, {k: v for k, v in (p if rows else worker._stand_in(p)).items()
                                                    if k != "head_rows"})[0] for rows, p in packed]
    own = [len(p["targets"]) if rows else 1 for rows, p in packed]
    return (agreed, passes, len(reduces), [p["head_rows"] for _, p in packed], own,
            [torch.equal(a, b) for a, b in zip(got, alone)], [len(x) for x in got])


def test_a_worker_agrees_the_head_rows_of_all_its_micro_batches_at_once(two_ranks):
    (agreed0, passes0, per_pass0, most0, own0, same0, n0), (agreed1, passes1, per_pass1, most1, own1, same1, n1) = \
        two_ranks[("worker", 0)], two_ranks[("worker", 1)]
    k = len(most0)
    assert k > 1 and len(most1) == k and own0 != own1
    # one collective for the micro-batch count, one vector for every micro-batch's head rows
    assert agreed0 == agreed1 == [1, k]
    assert passes0 == passes1 == []  # no collective (nor a host read) in the head passes
    assert per_pass0 == per_pass1 == k  # without head_rows: one per pass, as before
    assert most0 == most1 == [max(a, b) for a, b in zip(own0, own1)]
    assert all(same0) and all(same1) and n0 == own0 and n1 == own1


def _supervised_checks(rank: int) -> dict:
    """SFT micro-batches with different numbers of trained tokens on the two ranks, the LM head
    marked as ZeRO-3's and called on 4 rows at a time: with the driver's ``head_rows``
    (``rlhf.loops.supervised.agree_head_rows``, run alike on every rank as the driver runs it once)
    the forward and backward passes run no collective, and the head as often as on the other rank;
    the losses and gradients equal those of the passes that agree their own rows by a collective."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import rlhf.algos.logprobs as L
    from rlhf.data.sft import Row, collate
    from rlhf.algos.offline import SFTObjective
    from rlhf.loops.supervised import agree_head_rows
    from rlhf.models.varlen import use_varlen

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).double()
    use_varlen(model)
    model.lm_head.weight.ds_id = 0
    calls = []
    model.lm_head.register_forward_pre_hook(lambda *_: calls.append(1))

    def mb(trained: list[int]) -> dict:
        rows = []
        for i, n in enumerate(trained):
            r = Row()
            r.add([1 + i, 2, 3] + [4 + (j % 40) for j in range(n)], [0, 0, 0] + [1] * n, 0)
            rows.append(r)
        return {**collate(rows, 0), "loss_scale": torch.tensor(0.1, dtype=torch.float64)}

    # rank 0 trains 2 and 3 + 2 tokens, rank 1 6 + 7 and 1: alone, 1 and 2 head calls per pass against 4 and 1
    shards = agree_head_rows([[mb([2]), mb([3, 2])], [mb([6, 7]), mb([1])]], zero3=True)
    chunk = L.CHUNK_ELEMENTS
    L.CHUNK_ELEMENTS = 4 * 50
    runs = {}
    try:
        with counting_all_reduces() as reduces:
            for agreed in (True, False):
                got = []
                for m in shards[rank]:
                    m = m if agreed else {k: v for k, v in m.items() if k != "head_rows"}
                    calls.clear(), reduces.clear()
                    model.zero_grad()
                    loss, _ = SFTObjective()(model, m)
                    loss.backward()
                    got.append((len(calls), len(reduces), loss.detach(), [p.grad.clone() for p in model.parameters()]))
                runs[agreed] = got
    finally:
        L.CHUNK_ELEMENTS = chunk
    return {"head_rows": [m["head_rows"] for m in shards[rank]], "own": [len(m["scored_index"]) for m in shards[rank]],
            "calls": [c for c, *_ in runs[True]], "reduces": [r for _, r, *_ in runs[True]],
            "reduces_alone": [r for _, r, *_ in runs[False]],
            "same": all(torch.equal(a[2], b[2]) and all(torch.equal(x, y) for x, y in zip(a[3], b[3]))
                        for a, b in zip(runs[True], runs[False]))}


def test_supervised_passes_take_the_head_rows_the_driver_agreed(two_ranks):
    r0, r1 = two_ranks[("supervised", 0)], two_ranks[("supervised", 1)]
    assert r0["own"] == [2, 5] and r1["own"] == [13, 1]
    assert r0["head_rows"] == r1["head_rows"] == [13, 5]
    # ceil(13 / 4) = 4 and ceil(5 / 4) = 2 chunks, each called in the forward and again in the backward
    assert r0["calls"] == r1["calls"] == [8, 4]
    assert r0["reduces"] == r1["reduces"] == [0, 0]  # no collective (nor a host read) in the passes
    assert r0["reduces_alone"] == r1["reduces_alone"] == [1, 1]  # without head_rows: one each, as before
    assert r0["same"] and r1["same"]
