"""Under ZeRO-3 every rank must call the LM head as often as the others (each call gathers the
partitioned weight). rlhf.workers.zero3.equal_head_rows pads a rank's rows to the largest count;
checked on two gloo ranks with a head whose weight carries ZeRO-3's ``ds_id`` mark: equal head
calls, and the same log-probs and weight gradient as without padding."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.algos import logprobs_from_hidden
from rlhf.workers.zero3 import equal_head_rows


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


def test_ranks_call_a_zero3_head_equally_and_padding_changes_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
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
