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


def doc_activations(m: dict, t: int, checkpointing: bool) -> float:
    """t tokens per packed micro-batch; one chunk of at most 2^24 fp32 logits and its gradient."""
    h, L, V = m["hidden"], m["n_layers"], m["vocab"]
    b = 2 if m["dtype"] in ("bfloat16", "float16") else 4
    layers = (2 * t * h * L + 34 * t * h) if checkpointing else 34 * t * h * L
    return (layers * (b / 2) + 8 * min(t * V, 2**24)) / 1e9


LLAMA8 = ("algo=grpo", "model=llama3-8b", "hardware=8xh100")


def test_llama3_8b_parameter_count_matches_the_doc():
    assert doc_params(load("model", "llama3-8b")) == 8_030_261_248
    assert "8,030,261,248" in DOC.read_text()


def test_hybrid_plan_figures_follow_the_doc(capsys):
    out = plan(capsys, *LLAMA8, "placement=hybrid")
    m, md, hw = load("model", "llama3-8b"), load("model_defaults", "llama3-8b"), load("hardware", "8xh100")
    P, N, b = doc_params(m), hw["devices_per_node"] * hw["nodes"], 2
    assert "zero_stage" not in md["train"]  # auto: the doc's rule picks ZeRO-2 (it fits, see below)
    s = md["rollout"]["max_prompt_tokens"] + md["rollout"]["max_response_tokens"]
    t = md["train"]["micro_batch_size"] * s
    assert f"≤ {t} tokens per micro-batch" in out
    expect = {
        "actor weights": b * P / 1e9,
        "actor grads": b * P / N / 1e9,
        "actor optimizer": 12 * P / N / 1e9,
        "reference weights": b * P / 1e9,
        "activations": doc_activations(m, t, md["model"]["gradient_checkpointing"]),
        "runtime": 2.0,
        "vLLM asleep": 1.0,
    }
    for part, gb in expect.items():
        assert figure(out, "training phase:", part) == pytest.approx(gb, abs=0.051), part
    assert total(out, "training phase:") == pytest.approx(sum(expect.values()), abs=0.051)
    cap = 0.95 * hw["device_memory_gb"]
    assert sum(expect.values()) <= cap
    assert "steps: 100 · ZeRO-2 · seed 0" in out
    assert "ZeRO-2 (auto: the training phase fits at ZeRO-2 (56 of 76 GB usable)" in out
    vllm_w = b * P / 1 / 1e9
    share = 0.5 * hw["device_memory_gb"]
    # resident, the states would not fit next to vLLM: the doc's rule offloads them
    resident = expect["actor weights"] + expect["actor grads"] + expect["actor optimizer"] + expect["reference weights"]
    assert share + resident + 2.0 > cap
    assert "training states offloaded while vLLM generates (auto: resident, the training states would make " \
           f"the generation phase {share + resident + 2.0:.0f} GB" in out
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
    N_actor = 4
    assert "· ZeRO-2 ·" in out
    assert figure(out, "actor:", "actor optimizer") == pytest.approx(12 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "actor:", "actor grads") == pytest.approx(2 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "actor:", "actor weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "reference:", "reference weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "reference:", "logits") == pytest.approx(4 * 2**24 / 1e9, abs=0.051)
    assert total(out, "actor:") == pytest.approx(
        (2 + 2 / N_actor + 12 / N_actor) * P / 1e9 + doc_activations(m, 8 * 2048, True) + 2.0, abs=0.051)
    assert "✓ fits" in out


def test_zero_stage_and_offload_change_the_figures_as_documented(capsys):
    m = load("model", "llama3-8b")
    P = doc_params(m)
    out = plan(capsys, *LLAMA8, "train.zero_stage=1")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer") == pytest.approx(12 * P / 8 / 1e9, abs=0.051)
    out = plan(capsys, *LLAMA8, "train.zero_stage=3")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    assert figure(out, "training phase:", "reference weights") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    out = plan(capsys, *LLAMA8, "train.zero_stage=2", "train.offload_optimizer=true",
               "model.gradient_checkpointing=false", "train.max_tokens_per_micro_batch=4096")
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    assert "actor optimizer" not in out.split("training phase:")[1].split("\n")[0]
    assert figure(out, "training phase:", "activations") == pytest.approx(doc_activations(m, 4096, False), abs=0.051)
    assert "≤ 4096 tokens per micro-batch" in out


def test_lora_rl_reference_is_the_policy_without_adapters(capsys):
    """docs/memory.md: RL with LoRA has no reference model of its own (the actor with its adapters
    off gives the reference log-probs): no reference role, no reference weights, in either placement."""
    out = plan(capsys, *LLAMA8, "model.lora.rank=16")
    assert "reference" not in out.split("placement (hybrid")[1]
    out = plan(capsys, *LLAMA8, "model.lora.rank=16", "placement=disaggregated", "placement.reference=0")
    assert "reference" not in out.split("placement (disaggregated")[1]


def test_zero3_only_when_several_ranks_and_zero2_does_not_fit(capsys):
    # one rank: never ZeRO-3, the optimizer goes to host memory instead
    out = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200")
    assert "· ZeRO-2 · optimizer offloaded ·" in out
    assert "ZeRO-2 (auto: 1 rank; ZeRO-3 only shards over several ranks)" in out
    assert "optimizer offloaded (auto: Adam's state (91 GB per GPU) in host memory" in out
    assert "✓ fits" in out
    # two ranks, ZeRO-2 does not fit without checkpointing: ZeRO-3 rather than a host optimizer
    out = plan(capsys, "model=qwen2.5-7b", "hardware=2xh200", "model.gradient_checkpointing=false")
    assert "· ZeRO-3 · seed" in out
    assert "ZeRO-3 (auto: at ZeRO-2 the training phase needs 143 GB of 134 usable; ZeRO-3 shards the weights over 2 ranks)" in out
    # CPU: ZeRO-0, as the tiny runs always had
    out = plan(capsys)
    assert "· ZeRO-0 · seed" in out and "ZeRO-0 (auto: CPU run)" in out


def test_states_stay_resident_when_both_phases_fit(capsys):
    m, hw = load("model", "qwen2.5-0.5b"), load("hardware", "1xh200")
    P = doc_params(m)
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200")
    resident = (2 + 2 + 12 + 2) * P / 1e9  # actor (ZeRO-2, 1 rank) + reference
    assert figure(out, "generation phase:", "training state (resident)") == pytest.approx(resident, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(0.5 * hw["device_memory_gb"] + resident + 2, abs=0.051)
    assert "training states stay on the GPU while vLLM generates (auto: the generation phase fits" in out
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", "placement.offload_train_state=true")
    assert "training state" not in out.split("generation phase:")[1].split("\n")[0]
    assert "(auto:" not in out.split("ZeRO-2 (auto")[1]  # a pinned value has no auto line


def test_llama3_70b_on_one_h200_does_not_fit_and_the_plan_says_so(capsys):
    out = plan(capsys, "model=llama3-70b", "hardware=1xh200")
    assert "✗ does not fit: the training phase needs" in out
    assert "the GPU has 141 GB" in out
    assert "hardware.devices_per_node=8 (fits" in out
    assert "→ a setting that fits: hardware.devices_per_node=8 placement.rollout.tensor_parallel=8" in out
    assert out.rstrip().endswith("✗ does not fit (see above)")


def test_the_doc_states_the_constants_the_code_uses():
    text = DOC.read_text()
    assert f"| {memory.CUDA_OVERHEAD_GB:g} GB | `CUDA_OVERHEAD_GB`" in text
    assert f"| {memory.VLLM_ASLEEP_GB:g} GB | `VLLM_ASLEEP_GB`" in text
    assert f"| {memory.ACT_BYTES_PER_LAYER} | `ACT_BYTES_PER_LAYER`" in text
    assert f"| {memory.FIT_MARGIN:g} | `FIT_MARGIN`" in text
    assert memory.LOGITS_CHUNK == 2**24 and "| 2²⁴ | `LOGITS_CHUNK`" in text
