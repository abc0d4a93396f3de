"""Plan memory figures, recomputed here from the formulas in docs/memory.md (not from rlhf.spec.memory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rlhf import cli
from rlhf.paths import conf_dir
from rlhf.spec import memory

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def plan(capsys, *overrides: str) -> str:
    assert cli.main([*overrides, "--plan"]) == 0
    return capsys.readouterr().out


def figure(text: str, line_start: str, part: str) -> float:
    line = next(l for l in text.splitlines() if l.strip().startswith(line_start))
    m = re.search(rf"{re.escape(part)} (\d+\.\d)", line)
    assert m, (part, line)
    return float(m.group(1))


def total(text: str, line_start: str) -> float:
    line = next(l for l in text.splitlines() if l.strip().startswith(line_start))
    return float(re.search(r"= (\d+\.\d) of", line).group(1))


def load(group: str, name: str) -> dict:
    return yaml.safe_load((conf_dir() / group / f"{name}.yaml").read_text())


# ---- the doc's formulas, written again from docs/memory.md


def doc_params(m: dict, value_head: bool = False) -> int:
    V, h, I, L, H, K = m["vocab"], m["hidden"], m["intermediate"], m["n_layers"], m["n_heads"], m["n_kv_heads"]
    per_layer = 2 * h * h + 2 * h * (h // H) * K + 3 * h * I + 2 * h
    body = V * h + L * per_layer + h
    if value_head:
        return body + h
    return body + (0 if m["tie_embeddings"] else V * h)


def doc_activations(m: dict, s: int, B: int, checkpointing: bool) -> float:
    h, L, V = m["hidden"], m["n_layers"], m["vocab"]
    b = 2 if m["dtype"] in ("bfloat16", "float16") else 4
    layers = (2 * s * B * h * L + 34 * s * B * h) if checkpointing else 34 * s * B * h * L
    return (layers * (b / 2) + 8 * s * B * V) / 1e9


LLAMA8 = ("algo=grpo", "model=llama3-8b", "hardware=8xh100")


def test_llama3_8b_parameter_count_matches_the_doc():
    assert doc_params(load("model", "llama3-8b")) == 8_030_261_248
    assert "8,030,261,248" in DOC.read_text()


def test_hybrid_plan_figures_follow_the_doc(capsys):
    out = plan(capsys, *LLAMA8, "placement=hybrid")
    m, md, hw = load("model", "llama3-8b"), load("model_defaults", "llama3-8b"), load("hardware", "8xh100")
    P, N, b = doc_params(m), hw["devices_per_node"] * hw["nodes"], 2
    assert md["train"]["zero_stage"] == 3
    s = md["rollout"]["max_prompt_tokens"] + md["rollout"]["max_response_tokens"]
    B = md["train"]["micro_batch_size"]
    expect = {
        "actor weights": b * P / N / 1e9,
        "actor grads": b * P / N / 1e9,
        "actor optimizer": 12 * P / N / 1e9,
        "reference weights": b * P / N / 1e9,
        "activations": doc_activations(m, s, B, md["model"]["gradient_checkpointing"]),
        "runtime": 2.0,
        "vLLM asleep": 1.0,
    }
    for part, gb in expect.items():
        assert figure(out, "training phase:", part) == pytest.approx(gb, abs=0.051), part
    assert total(out, "training phase:") == pytest.approx(sum(expect.values()), abs=0.051)
    vllm_w = b * P / 1 / 1e9
    share = 0.5 * hw["device_memory_gb"]
    assert figure(out, "generation phase:", "vLLM weights") == pytest.approx(vllm_w, abs=0.051)
    assert figure(out, "generation phase:", "vLLM KV cache + activations") == pytest.approx(share - vllm_w, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(share + 2.0, abs=0.051)
    assert "✓ fits" in out and "does not fit" not in out
    assert "placement (hybrid, 8 devices)" in out


def test_disaggregated_plan_figures_follow_the_doc(capsys):
    out = plan(capsys, *LLAMA8, "placement=disaggregated")
    m = load("model", "llama3-8b")
    P = doc_params(m)
    assert "device 0-3: actor" in out  # 8 GPUs: rollout 2, actor 4 (largest power of two), reference 2
    assert "device 4-5: reference" in out
    N_actor, N_ref = 4, 2
    assert figure(out, "actor:", "actor optimizer") == pytest.approx(12 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "actor:", "actor weights") == pytest.approx(2 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "reference:", "reference weights") == pytest.approx(2 * P / N_ref / 1e9, abs=0.051)
    assert figure(out, "reference:", "logits") == pytest.approx(4 * 2048 * 8 * m["vocab"] / 1e9, abs=0.051)
    assert total(out, "actor:") == pytest.approx(
        (2 + 2 + 12) * P / N_actor / 1e9 + doc_activations(m, 2048, 8, True) + 2.0, abs=0.051)
    assert "✓ fits" in out


def test_zero_stage_and_offload_change_the_figures_as_documented(capsys):
    m = load("model", "llama3-8b")
    P = doc_params(m)
    out = plan(capsys, *LLAMA8, "train.zero_stage=1")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer") == pytest.approx(12 * P / 8 / 1e9, abs=0.051)
    out = plan(capsys, *LLAMA8, "train.zero_stage=2", "train.offload_optimizer=true",
               "model.gradient_checkpointing=false")
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    assert "actor optimizer" not in out.split("training phase:")[1].split("\n")[0]
    assert figure(out, "training phase:", "activations") == pytest.approx(
        doc_activations(m, 2048, 8, False), abs=0.051)


def test_llama3_70b_on_one_h200_does_not_fit_and_the_plan_says_so(capsys):
    out = plan(capsys, "model=llama3-70b", "hardware=1xh200")
    assert "✗ does not fit: the training phase needs" in out
    assert "the GPU has 141 GB" in out
    assert "train.offload_optimizer=true" in out and "GPUs of 141 GB" in out
    assert out.rstrip().endswith("✗ does not fit (see above)")


def test_the_doc_states_the_constants_the_code_uses():
    text = DOC.read_text()
    assert f"| {memory.CUDA_OVERHEAD_GB:g} GB | `CUDA_OVERHEAD_GB`" in text
    assert f"| {memory.VLLM_ASLEEP_GB:g} GB | `VLLM_ASLEEP_GB`" in text
    assert f"| {memory.ACT_BYTES_PER_LAYER} | `ACT_BYTES_PER_LAYER`" in text
    assert f"| {memory.FIT_MARGIN:g} | `FIT_MARGIN`" in text
