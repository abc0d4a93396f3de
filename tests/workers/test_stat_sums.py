"""The update's per-rank statistics (rlhf.workers.policy.StatSums) are summed as tensors and read
once: the mismatch figures over several micro-batches equal ``logprob_mismatch`` of all of them
at once, and token-weighted means equal the plain mean over every token."""

from __future__ import annotations

import torch

from rlhf.loops.rl import combine
from rlhf.algos.kl import logprob_mismatch
from rlhf.workers.policy import StatSums


def test_mismatch_and_means_over_micro_batches_equal_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    rollout = trainer + torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.05
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    mask[5] = 0  # a sample with no policy token
    st = StatSums()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        st.mismatch(trainer[rows], rollout[rows], mask[rows])
        ent = trainer[rows].float() * -1
        st.add("actor/entropy", (ent * mask[rows]).sum().double() / mask[rows].sum().clamp(min=1), mask[rows].sum())
    got = combine([st.result()])
    want = logprob_mismatch(rollout, trainer, mask)
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-12, (k, got[k], v)
    assert abs(got["actor/entropy"] - float((-trainer * mask).sum() / mask.sum())) < 1e-6
    assert all(isinstance(s, float) and isinstance(w, float) for s, w in st.result().values())


def test_no_policy_token_means_no_mismatch_figure():
    st = StatSums()
    st.mismatch(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert st.result() == {}
