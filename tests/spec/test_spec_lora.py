"""model.lora in the spec: validation messages, the plan line, and the memory figures recomputed
from the LoRA formulas of docs/memory.md (not from rlhf.plan.memory)."""

from __future__ import annotations

import pytest

from rlhf import cli
from tests.spec.test_spec_memory import doc_params, figure, load, plan

LLAMA8 = ("algo=grpo", "model=llama3-8b", "hardware=8xh100")


def doc_lora_params(m: dict, r: int) -> int:
    """docs/memory.md: P_lora = L · Σ r·(in + out) over q,k,v,o,gate,up,down."""
    h, I, L, H, K = m["hidden"], m["intermediate"], m["n_layers"], m["n_heads"], m["n_kv_heads"]
    kv = h // H * K
    return L * r * ((h + h) * 2 + (h + kv) * 2 + (h + I) * 2 + (I + h))


def test_llama3_8b_rank16_adapters_count_as_documented():
    assert doc_lora_params(load("model", "llama3-8b"), 16) == 41_943_040


def test_lora_plan_counts_frozen_weights_and_trained_adapters(capsys):
    m = load("model", "llama3-8b")
    P, PL = doc_params(m), doc_lora_params(m, 16)
    out = plan(capsys, *LLAMA8, "model.lora.rank=16", "model.lora.alpha=32", "train.zero_stage=0")
    assert "LoRA r=16 α=32 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (41.94 M trained" in out
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * (P + PL) / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * PL / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer") == pytest.approx(12 * PL / 1e9, abs=0.051)
    # ZeRO-3 over 8 GPUs shards all three
    out = plan(capsys, *LLAMA8, "model.lora.rank=16", "train.zero_stage=3")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * (P + PL) / 8 / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer") == pytest.approx(12 * PL / 8 / 1e9, abs=0.051)


@pytest.mark.parametrize("args,needles", [
    (["model.lora.rank=-1"], ["model.lora.rank=-1 must be >= 0"]),
    (["model.lora.rank=8", "model.lora.alpha=0"], ["model.lora.alpha=0.0 must be > 0", "16 is usual"]),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], ["model.lora.dropout=1.0 must be in [0, 1)"]),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], ["model.lora.target_modules is empty"]),
    (["algo=rm", "model.lora.rank=8"], ["model.lora.rank=8: LoRA trains causal-LM policies", "algo=rm",
                                         "Set model.lora.rank=0"]),
    (["model.lora.rnak=8"], ["model.lora.rnak"]),
])
def test_bad_lora_settings_are_one_line_each(capsys, args, needles):
    assert cli.main([*args, "--plan"]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, (n, err)


def test_lora_off_by_default_changes_nothing(capsys):
    out = plan(capsys, *LLAMA8)
    assert "LoRA" not in out
