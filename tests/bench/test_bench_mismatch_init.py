"""bench.mismatch_init: the two initialisations give the logit scales they are meant to (0.02·sqrt(hidden)
for transformers' default, about 1 for fan-in), and the bf16 trainer head's distance from the float64
forward is bf16-sized: positive, far below the log-probs themselves."""

from __future__ import annotations

import math

import pytest

from bench import mismatch_init


@pytest.mark.parametrize("init, logit_std", [("hf", 0.02 * math.sqrt(896)), ("fan_in", 1.0)])
def test_two_layers_at_the_05b_width(init, logit_std):
    r = mismatch_init.measure("qwen2.5-0.5b", layers=2, init=init, seqs=1, seq_len=32, seed=0)
    assert r["hidden"] == 896 and r["tokens"] == 32 and len(r["layer_rel_err"]) == 1
    assert r["logit_std"] == pytest.approx(logit_std, rel=0.05)
    assert 1e-4 < r["logp_abs_mean"] < 0.05 < abs(r["sampled_logp"])
    assert 1e-3 < r["hidden_rel_err"] < 0.05  # bf16 has 8 bits of mantissa: about 0.4 % a rounding
