"""Plan memory figures, recomputed here from the formulas in docs/memory.md (not from rlhf.plan.memory)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from rlhf import cli
from rlhf.paths import conf_dir
from rlhf.rollout import vllm_kind
from rlhf.plan import memory
from rlhf.spec.schema import LoraSpec, ModelSpec

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


CUDA_CHUNK = 2**28  # logits per log-prob chunk on a GPU (2**26 on CPU)


def doc_layer_bytes(m: dict, liger: bool = False) -> float:
    """Bytes a decoder layer keeps per token: 20h + 8I + 4·kv + 4·heads at 16 bits with HF's layers,
    12h + 6I + 4·kv + 4·heads with Liger's kernels."""
    h, H, K = m["hidden"], m["n_heads"], m["n_kv_heads"]
    b = 2 if m["dtype"] in ("bfloat16", "float16") else 4
    a, c = (12, 6) if liger else (20, 8)
    return (a * h + c * m["intermediate"] + 4 * (h // H) * K + 4 * H) * b / 2


def doc_activations(m: dict, t: int, checkpointing: bool, liger: bool = False) -> float:
    """t tokens per packed micro-batch: the layers (or, checkpointed, each layer's input and one
    layer) and the final norm's 8h per token (4h with Liger's kernels)."""
    h, L = m["hidden"], m["n_layers"]
    b = 2 if m["dtype"] in ("bfloat16", "float16") else 4
    layer = doc_layer_bytes(m, liger)
    layers = (2 * t * h * L * b / 2 + layer * t) if checkpointing else layer * t * L
    return (layers + (4 if liger else 8) * h * t * b / 2) / 1e9


def doc_logprob(m: dict, t: int, zero_stage: int, chunk: int = CUDA_CHUNK, lora: bool = False,
                keep: int = 2**33, compiled: bool = True) -> float:
    """docs/memory.md's log-prob pass: a plain head keeps its t·V bf16 logits up to ``keep`` of them,
    with k B per logit of one chunk (2 compiled, 10 eager) and its bf16 weight gradient 2·V·h when
    it trains; past ``keep`` the larger of that at ``keep`` and the recomputing backward's 12 B per
    logit of a chunk + 4·V·h; 18 B per logit of a chunk for a ZeRO-3 head (autograd)."""
    V, h = m["vocab"], m["hidden"]
    logits = min(t * V, chunk)
    if zero_stage == 3:
        return 18 * logits / 1e9
    k, head = (2 if compiled else 10), (0 if lora else 2 * V * h)
    if t * V <= keep:
        return (2 * t * V + k * logits + head) / 1e9
    return max(2 * keep + k * logits + head, 12 * logits + (0 if lora else 4 * V * h)) / 1e9


def doc_forward_pass(m: dict, t: int, chunk: int = CUDA_CHUNK, liger: bool = False) -> float:
    return (doc_layer_bytes(m, liger) * t + 14 * min(t * m["vocab"], chunk)) / 1e9


def doc_zero_buffers(m: dict, z: int) -> float:
    h, H, K, I = m["hidden"], m["n_heads"], m["n_kv_heads"], m["intermediate"]
    layer = 2 * h * h + 2 * h * (h // H) * K + 3 * h * I + 2 * h
    extra = 2 * (2 * layer + m["vocab"] * h + 5e7) if z == 3 else 0
    return (2 * 5e8 + extra) / 1e9


LLAMA8 = ("algo=grpo", "model=llama3-8b", "hardware=8xh100")


def test_llama3_8b_parameter_count_matches_the_doc():
    assert doc_params(load("model", "llama3-8b")) == 8_030_261_248
    assert "8,030,261,248" in DOC.read_text()


def test_hybrid_plan_figures_follow_the_doc(capsys):
    """docs/memory.md's worked example, with the GPU default: Liger's kernels on. ZeRO-2 fits the
    training phase, so the auto rule keeps it, and then the training states cannot stay resident
    next to vLLM; pinned to ZeRO-3 (the doc's second half) they can."""
    m, md, hw = load("model", "llama3-8b"), load("model_defaults", "llama3-8b"), load("hardware", "8xh100")
    s = md["rollout"]["max_prompt_tokens"] + md["rollout"]["max_response_tokens"]
    t = md["train"]["micro_batch_size"] * s  # the doc's t, pinned (null keeps it here: below)
    out = plan(capsys, *LLAMA8, "placement=hybrid", "model.liger_kernels=true", f"train.max_tokens_per_micro_batch={t}")
    P, N, b = doc_params(m), hw["devices_per_node"] * hw["nodes"], 2
    assert "zero_stage" not in md["train"]  # auto: the doc's rule picks ZeRO-2 (it fits, below)
    assert f"≤ {t} tokens per micro-batch (train.max_tokens_per_micro_batch)" in out
    fixed = {"runtime": 2.0, "vLLM asleep": 1.0}  # no allocator slack on these
    act = doc_activations(m, t, md["model"]["gradient_checkpointing"], liger=True)
    ref_pass = doc_forward_pass(m, t, liger=True)
    cap = 0.95 * hw["device_memory_gb"]
    vllm_w, share = b * P / 1 / 1e9, 0.5 * hw["device_memory_gb"]
    # ZeRO-2: weights whole, gradients and Adam's state sharded; the head whole, so the log-prob
    # pass is the written-out backward's chunk and the head's fp32 weight gradient
    zero2 = {"actor weights": b * P / 1e9, "actor grads": b * P / N / 1e9, "actor optimizer": 12 * P / N / 1e9,
             "reference weights": b * P / 1e9, "actor ZeRO buffers": doc_zero_buffers(m, 2),
             "actor optimizer step": 6 * P / N / 1e9, "activations": act,
             "log-prob pass": doc_logprob(m, t, zero_stage=2), "reference pass": ref_pass}
    zero2["allocator slack"] = 0.05 * sum(zero2.values())
    zero2.update(fixed)
    assert sum(zero2.values()) <= cap
    assert f"ZeRO-2 (auto: the training phase fits at ZeRO-2 ({sum(zero2.values()):.0f} of {cap:.0f} GB usable)" in out
    assert "steps: 100 · ZeRO-2 · seed 0" in out
    for part, gb in zero2.items():
        assert figure(out, "training phase:", part) == pytest.approx(gb, abs=0.051), part
    assert total(out, "training phase:") == pytest.approx(sum(zero2.values()), abs=0.051)
    # resident, ZeRO-2's whole weights next to vLLM would not fit: the doc's rule offloads them,
    # and only the frozen reference stays
    resident = sum(zero2[k] for k in ("actor weights", "actor grads", "actor optimizer", "reference weights"))
    assert 1.05 * resident + share + 2.0 > cap
    assert (f"training states offloaded while vLLM generates (auto: resident, the training states would make the "
            f"generation phase {1.05 * resident + share + 2.0:.0f} GB of {cap:.0f} usable)") in out
    frozen = zero2["reference weights"]
    assert figure(out, "generation phase:", "frozen weights (resident)") == pytest.approx(frozen, abs=0.051)
    assert figure(out, "generation phase:", "vLLM KV cache + activations") == pytest.approx(share - vllm_w, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(share + 1.05 * frozen + 2.0, abs=0.051)
    assert "✓ fits" in out and "does not fit" not in out
    assert "placement (hybrid, 8 devices)" in out
    # ZeRO-3 pinned: everything sharded, the gathered layers in the buffers; the partitioned head
    # goes through autograd (18 B per logit of one chunk)
    # null: the auto budget tries the next power of two, which does not fit at ZeRO-2, and keeps t
    out = plan(capsys, *LLAMA8, "placement=hybrid", "model.liger_kernels=true")
    assert (f"≤ {t} tokens per micro-batch (train.max_tokens_per_micro_batch null: {md['train']['micro_batch_size']} "
            f"samples × {s} tokens; {2 * t} would make the training phase") in out
    out = plan(capsys, *LLAMA8, "placement=hybrid", "model.liger_kernels=true", "train.zero_stage=3",
               f"train.max_tokens_per_micro_batch={t}")
    expect = {"actor weights": b * P / N / 1e9, "actor grads": b * P / N / 1e9, "actor optimizer": 12 * P / N / 1e9,
              "reference weights": b * P / N / 1e9, "actor ZeRO buffers": doc_zero_buffers(m, 3),
              "actor optimizer step": 6 * P / N / 1e9, "activations": act,
              "log-prob pass": doc_logprob(m, t, zero_stage=3), "reference pass": ref_pass}
    expect["allocator slack"] = 0.05 * sum(expect.values())
    expect.update(fixed)
    for part, gb in expect.items():
        assert figure(out, "training phase:", part) == pytest.approx(gb, abs=0.051), part
    assert total(out, "training phase:") == pytest.approx(sum(expect.values()), abs=0.051)
    assert "steps: 100 · ZeRO-3 · seed 0" in out
    # resident, the (sharded) states fit next to vLLM: the doc's rule keeps them on the GPU
    resident = sum(expect[k] for k in ("actor weights", "actor grads", "actor optimizer", "reference weights"))
    assert 1.05 * resident + share + 2.0 <= cap
    assert "training states stay on the GPU while vLLM generates (auto: the generation phase fits" in out
    assert figure(out, "generation phase:", "training state (resident)") == pytest.approx(resident, abs=0.051)
    assert figure(out, "generation phase:", "allocator slack") == pytest.approx(0.05 * resident, abs=0.051)
    assert figure(out, "generation phase:", "vLLM weights") == pytest.approx(vllm_w, abs=0.051)
    assert figure(out, "generation phase:", "vLLM KV cache + activations") == pytest.approx(share - vllm_w, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(share + 1.05 * resident + 2.0, abs=0.051)
    assert "✓ fits" in out and "does not fit" not in out


def test_disaggregated_plan_figures_follow_the_doc(capsys):
    # ZeRO-2 pinned: the figures at the stage the formulas below describe (auto picks ZeRO-3 here)
    out = plan(capsys, *LLAMA8, "placement=disaggregated", "train.offload_optimizer=false", "model.liger_kernels=false",
               "train.zero_stage=2")
    m = load("model", "llama3-8b")
    P = doc_params(m)
    assert "device 0-3: actor" in out  # 8 GPUs: rollout 2, actor 4 (largest power of two), reference 2
    assert "device 4-5: reference" in out
    N_actor, t = 4, 8 * 2048
    assert "· ZeRO-2 ·" in out
    assert figure(out, "actor:", "actor optimizer") == pytest.approx(12 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "actor:", "actor grads") == pytest.approx(2 * P / N_actor / 1e9, abs=0.051)
    assert figure(out, "actor:", "actor weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "actor:", "log-prob pass") == pytest.approx(doc_logprob(m, t, zero_stage=2), abs=0.051)
    assert figure(out, "reference:", "reference weights") == pytest.approx(2 * P / 1e9, abs=0.051)  # whole below ZeRO-3
    # the reference's forward pass: one layer's activations and one chunk of logits, as in hybrid
    assert figure(out, "reference:", "reference pass") == pytest.approx(doc_forward_pass(m, t), abs=0.051)
    # each role's tensors get the allocator's 5 % slack; the runtime does not
    assert total(out, "reference:") == pytest.approx(1.05 * (2 * P / 1e9 + doc_forward_pass(m, t)) + 2.0, abs=0.051)
    assert total(out, "actor:") == pytest.approx(1.05 * (
        (2 + 2 / N_actor + 12 / N_actor + 6 / N_actor) * P / 1e9 + doc_zero_buffers(m, 2)
        + doc_activations(m, t, True) + doc_logprob(m, t, zero_stage=2)) + 2.0, abs=0.051)


def test_zero_stage_and_offload_change_the_figures_as_documented(capsys):
    m = load("model", "llama3-8b")
    P = doc_params(m)
    out = plan(capsys, *LLAMA8, "train.zero_stage=1", "train.offload_optimizer=false")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer") == pytest.approx(12 * P / 8 / 1e9, abs=0.051)
    assert figure(out, "training phase:", "actor optimizer step") == pytest.approx(6 * P / 8 / 1e9, abs=0.051)
    out = plan(capsys, *LLAMA8, "train.zero_stage=3")
    assert figure(out, "training phase:", "actor weights") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    assert figure(out, "training phase:", "reference weights") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    # a partitioned head goes through autograd: 18 B per logit of one chunk, no whole weight gradient
    assert figure(out, "training phase:", "log-prob pass") == pytest.approx(18 * 2**28 / 1e9, abs=0.051)
    out = plan(capsys, *LLAMA8, "train.zero_stage=2", "train.offload_optimizer=true",
               "model.gradient_checkpointing=false", "train.max_tokens_per_micro_batch=4096",
               "model.liger_kernels=false")
    line = out.split("training phase:")[1].split("\n")[0]
    assert figure(out, "training phase:", "actor grads") == pytest.approx(2 * P / 8 / 1e9, abs=0.051)
    assert "actor optimizer" not in line  # neither Adam's state nor the step's fp32 copy on the GPU
    assert figure(out, "training phase:", "activations") == pytest.approx(doc_activations(m, 4096, False), abs=0.051)
    assert figure(out, "training phase:", "log-prob pass") == pytest.approx(doc_logprob(m, 4096, zero_stage=2), abs=0.051)
    assert "≤ 4096 tokens per micro-batch" in out
    # host: ZeRO-Offload's 16 B per parameter, the 8 ranks' partitions on the one node
    host = out.split("host memory per node:")[1].split("\n")[0]
    assert float(re.search(r"optimizer \(offloaded\) (\d+\.\d)", host).group(1)) == pytest.approx(16 * P / 1e9, abs=0.051)


def test_lora_rl_reference_is_the_policy_without_adapters(capsys):
    """docs/memory.md: RL with LoRA has no reference model of its own (the actor with its adapters
    off gives the reference log-probs): no reference role, no reference weights, in either placement."""
    out = plan(capsys, *LLAMA8, "model.lora.rank=16")
    assert "reference" not in out.split("placement (hybrid")[1]
    out = plan(capsys, *LLAMA8, "model.lora.rank=16", "placement=disaggregated", "placement.reference=0")
    assert "reference" not in out.split("placement (disaggregated")[1]


def test_zero3_only_when_several_ranks_and_zero2_does_not_fit(capsys):
    # one rank: never ZeRO-3, and ZeRO-1 rather than ZeRO-2 (the same memory at one rank, without
    # ZeRO-2's gradient hooks); the optimizer would go to host memory, but 1xh200's 125 GB cannot hold it
    out = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200")
    assert "· ZeRO-1 · seed" in out
    assert "ZeRO-1 (auto: 1 rank: ZeRO-2's gradient hooks would partition nothing" in out
    assert "optimizer on the GPU (auto: offloaded, Adam's state would make the host memory" in out
    # with the host memory unchecked the optimizer is offloaded, at ZeRO-2 (DeepSpeed's CPU Adam path)
    out = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200", "hardware.host_memory_gb=0")
    assert "· ZeRO-2 · optimizer offloaded ·" in out
    assert "ZeRO-2 (auto: 1 rank, the optimizer in host memory" in out
    assert "optimizer offloaded (auto: Adam's state (91 GB per GPU) in host memory" in out
    # pinned either way, the other follows: offload off → ZeRO-1, offload on → ZeRO-2
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", "train.offload_optimizer=false")
    assert "· ZeRO-1 · seed" in out
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", "train.offload_optimizer=true")
    assert "· ZeRO-2 · optimizer offloaded ·" in out
    # a critic with two ranks beside a one-rank actor (disaggregated): ZeRO-2, as from two ranks
    out = plan(capsys, "algo=ppo", "model=qwen2.5-0.5b", "hardware=8xh100", "placement=disaggregated",
               "placement.actor=1", "placement.critic=2", "placement.reference=1", "placement.rollout.engines=1")
    assert "· ZeRO-2 · seed" in out and "device 1-2: critic" in out
    # two ranks, ZeRO-2 does not fit without checkpointing: ZeRO-3 rather than a host optimizer
    out = plan(capsys, "model=qwen2.5-7b", "hardware=2xh200", "model.gradient_checkpointing=false",
               "train.max_tokens_per_micro_batch=4096")
    assert "· ZeRO-3 · seed" in out
    usable = 0.95 * load("hardware", "2xh200")["device_memory_gb"]  # 143
    assert re.search(rf"ZeRO-3 \(auto: at ZeRO-2 the training phase needs \d+ GB of {usable:.0f} usable; ZeRO-3 shards "
                     r"the weights over 2 ranks\)", out)
    # CPU: ZeRO-0, as the tiny runs always had
    out = plan(capsys)
    assert "· ZeRO-0 · seed" in out and "ZeRO-0 (auto: CPU run)" in out


def test_states_stay_resident_when_both_phases_fit(capsys):
    m, hw = load("model", "qwen2.5-0.5b"), load("hardware", "1xh200")
    P = doc_params(m)
    one = "placement.rollout.engines_per_device=1"  # a second engine's figures: tests/spec/test_spec_engines_per_device.py
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", one)
    resident = (2 + 2 + 12 + 2) * P / 1e9  # actor (ZeRO-2, 1 rank) + reference
    assert figure(out, "generation phase:", "training state (resident)") == pytest.approx(resident, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(0.5 * hw["device_memory_gb"] + 1.05 * resident + 2,
                                                            abs=0.051)
    assert "training states stay on the GPU while vLLM generates (auto: the generation phase fits" in out
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", one, "placement.offload_train_state=true")
    assert "training state" not in out.split("generation phase:")[1].split("\n")[0]
    # offloaded: the frozen reference (bf16) stays, DeepSpeed moves only what its optimizer holds
    assert figure(out, "generation phase:", "frozen weights (resident)") == pytest.approx(2 * P / 1e9, abs=0.051)
    assert total(out, "generation phase:") == pytest.approx(0.5 * hw["device_memory_gb"] + 1.05 * 2 * P / 1e9 + 2,
                                                            abs=0.051)
    # LoRA: no reference model; the policy's frozen base weights stay instead, and are not host-offloaded
    lora = ("model.lora.rank=16", "model.lora.alpha=32")
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", "placement.offload_train_state=true", *lora)
    assert figure(out, "generation phase:", "frozen weights (resident)") == pytest.approx(2 * P / 1e9, abs=0.051)
    host = re.search(r"^host memory per node: (.*)$", out, flags=re.M).group(1)
    assert figure("x " + host, "x", "training states (offloaded)") < 1.5  # adapters + reduce bucket, not 1 GB of base
    assert "training states offloaded while vLLM generates (auto:" not in out  # a pinned value has no auto line


def test_llama3_70b_on_one_h200_does_not_fit_and_the_plan_says_so(capsys):
    out = plan(capsys, "model=llama3-70b", "hardware=1xh200", "hardware.host_memory_gb=0")
    assert "✗ does not fit: the training phase needs" in out
    assert f"the GPU has {load('hardware', '1xh200')['device_memory_gb']:g} GB" in out
    assert "hardware.devices_per_node=8 (fits" in out
    # vLLM's 141 GB of bf16 weights at T = 4 leave 150.7 / 2 - 141.1 / 4 = 40.1 GB, over half of the
    # engine's share, for the KV cache (the doc's rule for T); at T = 2 they would not fit at all
    assert "→ a setting that fits: hardware.devices_per_node=8 placement.rollout.tensor_parallel=4" in out
    assert out.rstrip().endswith("✗ does not fit (see above)")


def test_the_plan_and_the_auto_choices_share_one_fit_rule(capsys, monkeypatch):
    """The fit margin is read in one place (rlhf.plan.memory.capacity): at half of a GPU usable the
    auto choices, the plan's warnings and its verdict all measure against 42 of 84.9 GB."""
    for module in ("rlhf.plan.auto", "rlhf.plan.render", "rlhf.plan.advice"):
        importlib.import_module(module)  # loaded before the margin changes, as any earlier plan would
    monkeypatch.setattr(memory, "FIT_MARGIN", 0.5)
    out = plan(capsys, *LLAMA8, "placement=hybrid")
    half = 0.5 * load("hardware", "8xh100")["device_memory_gb"]
    assert "ZeRO-3 (auto: at ZeRO-2 the training phase needs" in out and f"GB of {half:.0f} usable; ZeRO-3" in out
    assert "optimizer offloaded (auto: Adam's state" in out  # 52 GB with Adam on the GPU: over 42
    assert f"the generation phase 51 GB of {half:.0f} usable)" in out
    gpu = [l for l in out.splitlines() if l.startswith("✗ does not fit: the")]
    # the training phase fits in 42 with the optimizer offloaded; vLLM's half of the GPU alone does not
    assert [l.split(" needs")[0] for l in gpu] == ["✗ does not fit: the generation phase"]
    assert all("(50% usable)" in l for l in gpu)
    assert out.rstrip().endswith("✗ does not fit (see above)")


def test_the_doc_states_the_constants_the_code_uses():
    text = DOC.read_text()
    assert f"| {memory.CUDA_OVERHEAD_GB:g} GB | `CUDA_OVERHEAD_GB`" in text
    assert f"| {vllm_kind.VLLM_ASLEEP_GB:g} GB | `VLLM_ASLEEP_GB`" in text
    assert memory.ACT_BYTES_PER_LAYER == (20, 8, 4, 4) and "| 20·h + 8·I + 4·kv + 4·H | `ACT_BYTES_PER_LAYER`" in text
    assert memory.ACT_BYTES_PER_LAYER_LIGER == (12, 6, 4, 4) and \
        "| 12·h + 6·I + 4·kv + 4·H | `ACT_BYTES_PER_LAYER_LIGER`" in text
    for name in ("ACT_BYTES_FINAL_NORM", "ACT_BYTES_FINAL_NORM_LIGER"):
        assert f"| {getattr(memory, name)}·h | `{name}`" in text, name
    assert f"| {memory.FIT_MARGIN:g} | `FIT_MARGIN`" in text
    assert f"| {memory.HOST_FIT_MARGIN:g} | `HOST_FIT_MARGIN`" in text
    assert memory.LOGITS_CHUNK == 2**26 and "| 2²⁶ | `LOGITS_CHUNK`" in text
    assert memory.CUDA_LOGITS_CHUNK == 2**28 and "| 2²⁸ | `CUDA_LOGITS_CHUNK`" in text
    assert memory.KEEP_LOGITS == 2**28 and "| 2²⁸ | `KEEP_LOGITS`" in text
    assert memory.CUDA_KEEP_LOGITS == 2**33 and "| 2³³ | `CUDA_KEEP_LOGITS`" in text
    for name in ("LINEAR_CHUNK_BYTES_PER_LOGIT", "HEAD_GRAD_BYTES", "CHUNK_BYTES_PER_LOGIT",
                 "KEPT_CHUNK_BYTES_PER_LOGIT", "KEPT_CHUNK_BYTES_PER_LOGIT_COMPILED",
                 "FORWARD_CHUNK_BYTES_PER_LOGIT", "HOST_OFFLOAD_BYTES", "HOST_LOAD_TRAINED_BYTES"):
        assert f"| {getattr(memory, name)} B | `{name}`" in text, name
    for name in ("HOST_PROCESS_GB", "HOST_DRIVER_GB"):
        assert f"| {getattr(memory, name):g} GB | `{name}`" in text, name
    assert f"| {vllm_kind.HOST_VLLM_ENGINE_GB:g} GB | `HOST_VLLM_ENGINE_GB`" in text
    assert f"| {memory.ZERO_REDUCE_BUCKET:.0e} | `ZERO_REDUCE_BUCKET`".replace("e+0", "e") in text



def test_the_plan_chunks_the_logits_as_the_code_does():
    """rlhf.spec imports no torch, so the plan keeps its own copy of the log-prob chunk sizes."""
    from rlhf.algos import logprobs

    assert memory.LOGITS_CHUNK == logprobs.CHUNK_ELEMENTS
    assert memory.CUDA_LOGITS_CHUNK == logprobs.CUDA_CHUNK_ELEMENTS
    assert memory.logits_chunk("cuda") == logprobs.CUDA_CHUNK_ELEMENTS
    assert memory.logits_chunk("cpu") == logprobs.CHUNK_ELEMENTS
    assert memory.keep_logits("cuda") == logprobs.CUDA_KEEP_ELEMENTS == memory.CUDA_KEEP_LOGITS
    assert memory.keep_logits("cpu") == logprobs.KEEP_ELEMENTS == memory.KEEP_LOGITS


def _spec(m: dict, **kw) -> ModelSpec:
    return ModelSpec(**{**{k: v for k, v in m.items() if k != "defaults"}, **kw})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_liger_kernels_keep_8h_plus_2i_less_per_layer_and_4h_less_in_the_final_norm(dtype, checkpointing):
    """Liger's RMSNorm keeps its input instead of the fp32 upcast and the normalised copy (4h less
    per norm, two per layer and the final one); its SwiGLU recomputes SiLU(gate) (2I less)."""
    m = load("model", "qwen2.5-1.5b")
    h, I, L, t = m["hidden"], m["intermediate"], m["n_layers"], 32768
    scale = 2 / 2 if dtype == "bfloat16" else 4 / 2
    on, off, auto = (_spec(m, dtype=dtype, gradient_checkpointing=checkpointing, liger_kernels=v)
                     for v in (True, False, "auto"))
    layers = 1 if checkpointing else L  # checkpointed: one layer's full activations at a time
    want = ((8 * h + 2 * I) * layers * t + 4 * h * t) * scale / 1e9
    assert memory.activations_gb(off, t) - memory.activations_gb(on, t) == pytest.approx(want, rel=1e-12)
    assert memory.activations_gb(auto, t) == memory.activations_gb(off, t)  # unresolved: counted as off
    # the reference's forward pass runs the same layers
    assert memory.forward_pass_gb(off, t, 2**28) - memory.forward_pass_gb(on, t, 2**28) == \
        pytest.approx((8 * h + 2 * I) * t * scale / 1e9, rel=1e-12)


def test_the_log_prob_pass_keeps_the_logits_up_to_the_limit(capsys):
    """A plain head keeps its micro-batch's bf16 logits for the backward (2·t·V) up to 2^33 of them
    on a GPU, beside one compiled chunk's scratch (2 B per logit of a 2^28 chunk) and the bf16 weight
    gradient (2·V·h); past the limit the figure stays at the limit's (a micro-batch with fewer
    response tokens may keep that many)."""
    m = load("model", "qwen2.5-1.5b")
    V, h = m["vocab"], m["hidden"]
    base = ("model=qwen2.5-1.5b", "hardware=1xh200", "model.liger_kernels=true", "train.zero_stage=2",
            "train.offload_optimizer=false", "placement.offload_train_state=false",
            "rollout.max_prompt_tokens=256", "rollout.max_response_tokens=256")
    figures = {}
    for t in (512, 4096, 32768, 65536):
        out = plan(capsys, *base, f"train.max_tokens_per_micro_batch={t}")
        figures[t] = figure(out, "training phase:", "log-prob pass")
        want = 2 * min(t * V, 2**33) + 2 * min(t * V, 2**28) + 2 * V * h
        assert figures[t] == pytest.approx(want / 1e9, abs=0.051), t
    assert figures[512] < figures[4096] < figures[32768] < figures[65536]
    assert figures[65536] == pytest.approx((2 * 2**33 + 2 * 2**28 + 2 * V * h) / 1e9, abs=0.051)
    # eager chunk passes (train.compile_logprobs=false): 8 B per logit of a chunk
    out = plan(capsys, *base, "train.max_tokens_per_micro_batch=4096", "train.compile_logprobs=false")
    assert figure(out, "training phase:", "log-prob pass") == \
        pytest.approx((2 * 4096 * V + 8 * 2**28 + 2 * V * h) / 1e9, abs=0.051)


def test_past_the_limit_the_log_prob_pass_is_the_larger_of_keeping_and_recomputing():
    m = _spec(load("model", "qwen2.5-1.5b"))
    V, h = m.vocab, m.hidden
    # a small limit: recomputing each chunk (12 B per logit, fp32 weight gradient) is the larger
    assert memory.logprob_pass_gb(m, 65536, 2**28, 2, keep=2**20, compiled=True) == \
        pytest.approx((12 * 2**28 + 4 * V * h) / 1e9, rel=1e-12)
    assert memory.logprob_pass_gb(m, 65536, 2**28, 2, keep=0) == pytest.approx((12 * 2**28 + 4 * V * h) / 1e9, rel=1e-12)
    # LoRA: the head is frozen, no weight gradient; on CPU the chunk is 2^26 logits
    lora = _spec(load("model", "qwen2.5-1.5b"), lora=LoraSpec(rank=16))
    assert memory.logprob_pass_gb(lora, 65536, 2**28, zero_stage=2) == pytest.approx(12 * 2**28 / 1e9, rel=1e-12)
    assert memory.logprob_pass_gb(lora, 65536, 2**26, zero_stage=0) == pytest.approx(12 * 2**26 / 1e9, rel=1e-12)
    assert memory.logprob_pass_gb(lora, 4096, 2**28, 2, keep=2**33, compiled=True) == \
        pytest.approx((2 * 4096 * V + 2 * 2**28) / 1e9, rel=1e-12)
    # float32 weights keep float32 logits
    f32 = _spec(load("model", "qwen2.5-1.5b"), dtype="float32")
    assert memory.logprob_pass_gb(f32, 100, 2**26, 0, keep=2**28) == \
        pytest.approx((4 * 100 * V + 8 * 100 * V + 4 * V * h) / 1e9, rel=1e-12)


# ---- host memory (per node)


def test_7b_full_on_one_h200_does_not_fit_the_host_and_the_suggestion_fits(capsys):
    """ZeRO-Offload of 7.6 B parameters needs 16 B each on the host (122 GB) of the node's 125 GB:
    the plan says so, and the setting it names fits (GPU and host)."""
    P = doc_params(load("model", "qwen2.5-7b"))
    out = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200", "train.offload_optimizer=true")
    host = re.search(r"^host memory per node: (.*) = (\d+\.\d) of 125$", out, flags=re.M)
    assert host and float(re.search(r"optimizer \(offloaded\) (\d+\.\d)", host.group(1)).group(1)) == \
        pytest.approx(16 * P / 1e9, abs=0.051)
    assert "✗ does not fit: the host memory needs ~" in out and "most of it optimizer (offloaded)" in out
    fix = re.search(r"^→ a setting that fits: (.+)$", out, flags=re.M).group(1).split()
    fixed = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200", "train.offload_optimizer=true", *fix)
    assert fixed.rstrip().endswith("✓ fits") and "✗" not in fixed
    # auto: no offload the host cannot hold, so 7B full fine-tuning does not fit one H200 at all
    out = plan(capsys, "model=qwen2.5-7b", "hardware=1xh200")
    assert out.rstrip().endswith("✗ does not fit (see above)")
    fix = re.search(r"^→ a setting that fits: (.+)$", out, flags=re.M).group(1).split()
    assert plan(capsys, "model=qwen2.5-7b", "hardware=1xh200", *fix).rstrip().endswith("✓ fits")


def test_host_figure_parts_follow_the_doc(capsys):
    """GRPO 0.5B on one H200: the driver, the actor and reference processes and a vLLM engine;
    the actor loads in float32, the reference in bf16. PPO adds a critic process and its float32 load."""
    m = load("model", "qwen2.5-0.5b")
    P, Pv = doc_params(m), doc_params(m, value_head=True)
    one = "placement.rollout.engines_per_device=1"  # one vLLM process (a second adds its own 8 GB)
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", one)
    line = re.search(r"^host memory per node: (.*)$", out, flags=re.M).group(1)
    assert figure("x " + line, "x", "runtime") == pytest.approx(4 + 4 + 4 + 8, abs=0.051)
    assert figure("x " + line, "x", "model loading") == pytest.approx((4 * P + 2 * P) / 1e9, abs=0.051)
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", one, "algo=ppo", "placement.offload_train_state=true")
    line = re.search(r"^host memory per node: (.*)$", out, flags=re.M).group(1)
    assert figure("x " + line, "x", "model loading") == pytest.approx((4 * P + 4 * Pv + 2 * P) / 1e9, abs=0.051)
    # offloaded states: each trained role's weights, grads, Adam state (16 B/param at ZeRO-2, 1 rank)
    # and its reduce bucket
    assert figure("x " + line, "x", "training states (offloaded)") == pytest.approx(
        (16 * P + 16 * Pv + 2 * 2 * 5e8) / 1e9, abs=0.051)


def test_runs_without_generation_keep_their_states_on_the_gpu(capsys):
    """SFT, RM and DPO have no vLLM phase to make room for: nothing of theirs is counted as
    offloaded to the host (only the optimizer, when train.offload_optimizer says so)."""
    for algo in ("sft", "rm", "dpo"):
        out = plan(capsys, f"algo={algo}", "model=qwen2.5-1.5b", "hardware=1xh200")
        line = re.search(r"^host memory per node: (.*)$", out, flags=re.M).group(1)
        assert "training states" not in line, (algo, line)


def test_a_cpu_run_has_no_host_figure(capsys):
    from rlhf.spec.build import build

    out = plan(capsys)
    assert "host memory per node" not in out
    spec = build(cli.compose([]))
    assert memory.estimate(spec).host == {}
    assert spec.hardware.host_memory_gb == 0


def test_a_reward_model_pass_counts_in_both_hybrid_phases(capsys, tmp_path):
    """The reward model scores right after generation (vLLM awake) and keeps its blocks into the
    training phase: layer bytes · t in both figures (no head chunk: one score per sample)."""
    import json

    m = load("model", "qwen2.5-0.5b")
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=1xh200", "algo=ppo", f"reward.model_path={rm}")
    t = int(re.search(r"≤ (\d+) tokens per micro-batch", out).group(1))
    want = doc_layer_bytes(m) * t / 1e9
    assert figure(out, "training phase:", "reward model pass") == pytest.approx(want, abs=0.051)
    assert figure(out, "generation phase:", "reward model pass") == pytest.approx(want, abs=0.051)
    out = plan(capsys, "model=qwen2.5-0.5b", "hardware=8xh100", "algo=ppo", "placement=disaggregated",
               f"reward.model_path={rm}")
    t = int(re.search(r"≤ (\d+) tokens per micro-batch", out).group(1))
    assert figure(out, "reward:", "reward model pass") == pytest.approx(doc_layer_bytes(m) * t / 1e9, abs=0.051)


@pytest.mark.parametrize("algo,per_unit", [("sft", 1), ("rm", 2), ("dpo", 2)])
def test_supervised_passes_are_planned_at_what_their_micro_batch_holds(capsys, algo, per_unit):
    """sft/rm/dpo run train.micro_batch_size units of up to data.max_length tokens a pass, a pair
    (rm, dpo) being two sequences; they do not read the RL token budget. The plan's activations
    follow that product, so a longer data.max_length is a larger figure (it was the rollout's)."""
    m = load("model", "qwen2.5-1.5b")
    base = (f"algo={algo}", "model=qwen2.5-1.5b", "hardware=1xh200", "train.micro_batch_size=4",
            "model.gradient_checkpointing=true", "model.liger_kernels=false", "train.zero_stage=2")
    for length in (512, 4096):
        out = plan(capsys, *base, f"data.max_length={length}")
        t = 4 * per_unit * length
        unit = "4 pairs × 2 sequences" if per_unit == 2 else "4 examples"
        assert f"≤ {t} tokens per micro-batch ({unit} × {length} tokens (data.max_length))" in out
        assert figure(out, "training phase:", "activations") == pytest.approx(doc_activations(m, t, True), abs=0.051)
    # unset: the rollout's prompt + response budget is the sequence length
    out = plan(capsys, *base, "rollout.max_prompt_tokens=300", "rollout.max_response_tokens=200")
    assert f"≤ {4 * per_unit * 500} tokens per micro-batch" in out
    assert "× 500 tokens (rollout.max_prompt_tokens + rollout.max_response_tokens))" in out


def test_a_token_budget_for_a_supervised_run_is_refused_with_what_to_set(capsys):
    code = cli.main(["algo=dpo", "train.max_tokens_per_micro_batch=4096", "--plan"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.max_tokens_per_micro_batch=4096 is read by RL passes only" in err
    assert "set train.micro_batch_size or data.max_length instead" in err


def test_dpos_reference_and_its_update_are_not_on_the_gpu_at_once(capsys):
    """DPO's reference scores every pair before the first update and is released: the training
    phase holds the actor's states and the larger of (reference weights + reference pass) and
    (optimizer step + activations + log-prob pass), not both."""
    m = load("model", "qwen2.5-1.5b")
    base = ("algo=dpo", "model=qwen2.5-1.5b", "hardware=1xh200", "train.micro_batch_size=8",
            "model.liger_kernels=false", "train.zero_stage=2", "train.offload_optimizer=false",
            "model.gradient_checkpointing=true")
    out = plan(capsys, *base, "data.max_length=2048")  # long pairs: the update's working set is larger
    line = out.split("training phase:")[1].split("\n")[0]
    assert "reference" not in line and "activations" in line
    t = 8 * 2 * 2048
    assert figure(out, "training phase:", "activations") == pytest.approx(doc_activations(m, t, True), abs=0.051)
    # LoRA: no optimizer step of the whole model, short pairs: the reference's pass is the larger
    out = plan(capsys, *base, "data.max_length=16", "model.lora.rank=16", "model.lora.alpha=32")
    line = out.split("training phase:")[1].split("\n")[0]
    assert "reference weights" in line and "reference pass" in line
    assert "activations" not in line and "log-prob pass" not in line
    assert figure(out, "training phase:", "reference weights") == pytest.approx(2 * doc_params(m) / 1e9, abs=0.051)
    # the same settings in RL keep the reference beside the update (they run in one phase)
    out = plan(capsys, "algo=grpo", *base[1:], "algo.kl.coef=0.01")
    line = out.split("training phase:")[1].split("\n")[0]
    assert "reference weights" in line and "activations" in line
