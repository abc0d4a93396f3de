"""Per-device memory estimate of a run. Every formula here is written out in docs/memory.md.

All figures are GB (1e9 bytes). Estimates, not measurements: they aim to catch plans that cannot
fit and to show where the memory goes, not to predict the allocator to the megabyte.

Hybrid placement has two phases on every GPU (training, generation); disaggregated placement has
one figure per role, for the GPUs of that role. ``estimate`` returns both kinds as
``{name: {part: GB}}`` so the plan and the tests read them the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlhf.spec.schema import ModelSpec

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Runtime overhead per GPU process: CUDA context, NCCL buffers, allocator slack.
CUDA_OVERHEAD_GB = 2.0
# A sleeping vLLM engine (sleep level 1) keeps its CUDA context and CUDA-graph pool.
VLLM_ASLEEP_GB = 1.0
# Plans above this share of device memory are reported as not fitting.
FIT_MARGIN = 0.95
# Activation bytes per token per hidden unit of one transformer layer at 16 bits (Korthikanti et
# al. 2022, with flash attention so no s² term).
ACT_BYTES_PER_LAYER = 34
# Log-probs and entropy are computed from the hidden states in chunks of at most this many logits, so
# no [tokens, vocab] tensor is ever whole.
LOGITS_CHUNK = 2**24
# The figures that hold training state (hybrid's training phase, or a training role's GPUs).
TRAINING_FIGURES = ("training phase", "actor", "critic", "reference", "reward")


def param_count(m: ModelSpec, with_lm_head: bool = True) -> int:
    """Parameters of a Llama/Qwen-shaped decoder from its architecture numbers.

    embed = V·h; per layer: q,o = 2h², k,v = 2·h·(h/heads·kv_heads), MLP = 3·h·I, norms = 2h;
    final norm h; LM head V·h unless tied; a critic or reward model has a value head h·1 instead.
    (Attention biases, as in Qwen2.5, are left out: under 0.01 % of the total.)
    """
    h, head_dim = m.hidden, m.hidden // m.n_heads
    attn = 2 * h * h + 2 * h * head_dim * m.n_kv_heads
    layer = attn + 3 * h * m.intermediate + 2 * h
    body = m.vocab * h + m.n_layers * layer + h
    head = (0 if m.tie_embeddings else m.vocab * h) if with_lm_head else h
    return body + head


def lora_param_count(m: ModelSpec) -> int:
    """Parameters of the LoRA adapters (Hu et al. 2021) of ``m.lora`` (0 when rank is 0).

    A target Linear with ``in`` inputs and ``out`` outputs gets A (r × in) and B (out × r):
    r·(in + out). Per layer q,o: h → h; k,v: h → (h/H)·K; gate,up: h → I; down: I → h. Target names
    other than these seven add nothing here (the estimate knows only the Llama/Qwen projections).
    """
    r = m.lora.rank
    if r <= 0:
        return 0
    h, kv = m.hidden, m.hidden // m.n_heads * m.n_kv_heads
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, m.intermediate), "up_proj": (h, m.intermediate), "down_proj": (m.intermediate, h)}
    per_layer = sum(r * sum(shapes[t]) for t in set(m.lora.target_modules) if t in shapes)
    return m.n_layers * per_layer


def trained_model_gb(params: int, shards: int, zero_stage: int, offload_optimizer: bool, dtype: str) -> dict[str, float]:
    """Weights, gradients and Adam state of a trained model on one device (Rajbhandari et al. 2020).

    Mixed precision (16-bit weights) keeps weights 2P + gradients 2P + fp32 master weights,
    momentum and variance 12P; pure fp32 keeps 4P + 4P + Adam 8P. ZeRO-1 shards the optimizer state
    over the data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights. An offloaded
    optimizer lives in host memory.
    """
    b = DTYPE_BYTES[dtype]
    w, g = b * params, b * params
    opt = (12 if b == 2 else 8) * params
    n = max(shards, 1)
    if zero_stage >= 1:
        opt /= n
    if zero_stage >= 2:
        g /= n
    if zero_stage >= 3:
        w /= n
    if offload_optimizer:
        opt = 0.0
    return {"weights": w / GB, "grads": g / GB, "optimizer": opt / GB}


def frozen_model_gb(params: int, shards: int, zero_stage: int, dtype: str) -> float:
    """A model that only runs forward (reference, reward model): its weights, sharded at ZeRO-3."""
    return DTYPE_BYTES[dtype] * params / (max(shards, 1) if zero_stage >= 3 else 1) / GB


def activations_gb(m: ModelSpec, tokens: int, lm_head: bool = True) -> float:
    """Activation memory of one training micro-batch of ``tokens`` packed tokens (Korthikanti et al.
    2022, flash attention, no TP).

    Per layer 34·t·h bytes at 16 bits; with gradient checkpointing only each layer's input (2·t·h) is
    kept, plus one layer being recomputed (34·t·h). fp32 weights double it. A model with an LM head
    computes log-probs chunk by chunk from the hidden states: one chunk of fp32 logits and their
    gradient, 8·min(t·V, LOGITS_CHUNK) bytes.
    """
    th = tokens * m.hidden
    scale = DTYPE_BYTES[m.dtype] / 2
    if m.gradient_checkpointing:
        layers = (2 * th * m.n_layers + ACT_BYTES_PER_LAYER * th) * scale
    else:
        layers = ACT_BYTES_PER_LAYER * th * m.n_layers * scale
    logits = 8 * min(tokens * m.vocab, LOGITS_CHUNK) if lm_head else 0
    return (layers + logits) / GB


def logits_gb(m: ModelSpec, tokens: int) -> float:
    """A forward-only pass (reference log-probs): one chunk of fp32 logits, 4·min(t·V, LOGITS_CHUNK)."""
    return 4 * min(tokens * m.vocab, LOGITS_CHUNK) / GB


@dataclass
class Estimate:
    """GB per device: ``figures[name][part]``. Hybrid names: "training phase", "generation phase";
    disaggregated names: the roles ("actor", "critic", "reference", "reward", "rollout")."""

    mode: str
    figures: dict[str, dict[str, float]] = field(default_factory=dict)

    def total(self, name: str) -> float:
        return sum(self.figures[name].values())

    @property
    def totals(self) -> dict[str, float]:
        return {k: self.total(k) for k in self.figures}


def _vllm_parts(spec: Any, p_policy: int) -> dict[str, float]:
    """vLLM on one GPU: weights / TP, and its KV cache + activations filling the rest of its share."""
    hw, m = spec.hardware, spec.model
    weights = DTYPE_BYTES[m.dtype] * p_policy / spec.layout.rollout_tp / GB
    share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
    return {"vLLM weights": weights, "vLLM KV cache + activations": max(share - weights, 0.0)}


def estimate(spec: Any) -> Estimate:
    """Per-device memory of a built spec, for each phase (hybrid) or role (disaggregated)."""
    m, train, pl, hw, lay = spec.model, spec.train, spec.placement, spec.hardware, spec.layout
    tokens = train.max_tokens_per_micro_batch
    cuda = hw.accelerator == "cuda"
    runtime = {"runtime": CUDA_OVERHEAD_GB} if cuda else {}
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    z, off = train.zero_stage, train.offload_optimizer

    def states(role: str, params: int) -> dict[str, float]:
        parts = trained_model_gb(params, lay.world_size(role), z, off, m.dtype)
        return {f"{role} {k}": v for k, v in parts.items()}

    p_lora = lora_param_count(m)
    if p_lora:  # LoRA: the policy's weights are frozen; gradients and Adam state only for the adapters
        actor = states("actor", p_lora)
        actor["actor weights"] += frozen_model_gb(p_policy, lay.world_size("actor"), z, m.dtype)
    else:
        actor = states("actor", p_policy)
    actor_act = {"activations": activations_gb(m, tokens)}
    critic = states("critic", p_value) if "critic" in spec.roles else {}
    # RL with LoRA: the reference is the policy with its adapters disabled, so on the actor's GPUs
    # (hybrid) it needs no weights of its own.
    shared_reference = p_lora > 0 and pl.mode == "hybrid" and spec.algo.kind == "rl"
    reference = (
        {"reference weights": frozen_model_gb(p_policy, lay.world_size("reference"), z, m.dtype)}
        if "reference" in spec.roles and not shared_reference else {}
    )
    reward = (
        {"reward model weights": frozen_model_gb(p_value, lay.world_size("reward"), z, m.dtype)}
        if "reward" in spec.roles else {}
    )
    rollout = "rollout" in spec.roles

    est = Estimate(mode=pl.mode)
    if pl.mode == "hybrid":
        # Every GPU holds every role; one phase runs at a time. Critic activations never coexist
        # with the actor's (the updates run one after the other), so one activations term.
        train_phase = {**actor, **critic, **reference, **reward, **actor_act, **runtime}
        if rollout and cuda:
            if pl.sleep_rollout:
                train_phase["vLLM asleep"] = VLLM_ASLEEP_GB
            else:
                train_phase["vLLM (awake)"] = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
        est.figures["training phase"] = train_phase
        if rollout:
            gen = _vllm_parts(spec, p_policy) if cuda else {}
            resident = 0.0 if pl.offload_train_state else sum({**actor, **critic, **reference, **reward}.values())
            gen["training state (resident)" if resident else "training state (offloaded)"] = resident
            gen.update(runtime)
            est.figures["generation phase"] = gen
        return est

    # Disaggregated: each role on its own GPUs; a figure for one GPU of each.
    est.figures["actor"] = {**actor, **actor_act, **runtime}
    if critic:
        est.figures["critic"] = {**critic, "activations": activations_gb(m, tokens, lm_head=False), **runtime}
    if reference:
        est.figures["reference"] = {**reference, "logits": logits_gb(m, tokens), **runtime}
    if reward:
        est.figures["reward"] = {**reward, **runtime}
    if rollout:
        est.figures["rollout"] = {**(_vllm_parts(spec, p_policy) if cuda else {}), **runtime}
    return est


# ----------------------------------------------------------------------------- advice


def min_gpus(spec: Any, est: Estimate, name: str, offload_optimizer: bool | None = None) -> int:
    """About how many GPUs of this size a training figure (hybrid "training phase", or the actor,
    critic, reference or reward role) needs at ZeRO-3, where all model states shard over the GPUs
    and activations, runtime and a sleeping engine do not. 0: the unsharded parts alone do not fit."""
    m = spec.model
    b = DTYPE_BYTES[m.dtype]
    off = spec.train.offload_optimizer if offload_optimizer is None else offload_optimizer
    trained = 2 * b + (0 if off else (12 if b == 2 else 8))  # bytes per parameter
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    hybrid = name == "training phase"
    sharded = 0.0
    if hybrid or name == "actor":
        p_lora = lora_param_count(m)  # LoRA: frozen weights plus trained adapters
        sharded += b * p_policy + trained * p_lora if p_lora else trained * p_policy
    if (hybrid and "critic" in spec.roles) or name == "critic":
        sharded += trained * p_value
    shared_reference = lora_param_count(m) > 0 and spec.algo.kind == "rl"
    if (hybrid and "reference" in spec.roles and not shared_reference) or name == "reference":
        sharded += b * p_policy
    if (hybrid and "reward" in spec.roles) or name == "reward":
        sharded += b * p_value
    fixed = sum(v for k, v in est.figures[name].items() if not k.endswith(("weights", "grads", "optimizer")))
    room = spec.hardware.device_memory_gb * FIT_MARGIN - fixed
    return math.ceil(sharded / GB / room) if room > 0 else 0


def min_tensor_parallel(spec: Any) -> int:
    """The smallest TP (dividing a node and the heads) at which vLLM's weights leave half its
    share for the KV cache; 0 if none does."""
    from rlhf.spec.validate import tp_splits_heads

    m, hw = spec.model, spec.hardware
    share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
    weights = DTYPE_BYTES[m.dtype] * param_count(m) / GB
    for tp in range(1, hw.devices_per_node + 1):
        if hw.devices_per_node % tp == 0 and tp_splits_heads(m, tp) and weights / tp <= share / 2:
            return tp
    return 0
