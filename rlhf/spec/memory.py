"""Per-device memory estimate of a run, by phase. The formulas are documented in docs/memory.md.

All figures are GB (1e9 bytes). Estimates, not measurements: they aim to catch plans that cannot
fit, not to predict the allocator to the megabyte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.spec.schema import ModelSpec

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Runtime overhead per process on a GPU: CUDA context, NCCL buffers, allocator slack.
CUDA_OVERHEAD_GB = 2.0
# A sleeping vLLM engine (level 1) keeps its CUDA context and graph pool.
VLLM_ASLEEP_GB = 1.0
FIT_MARGIN = 0.95  # plans above 95% of device memory are reported as not fitting


def param_count(m: ModelSpec, with_lm_head: bool = True) -> int:
    """Parameters of a Llama/Qwen-shaped decoder from its architecture numbers.

    embed = V·h; per layer: q,o = 2h², k,v = 2·h·(h/heads·kv_heads), MLP = 3·h·I, norms = 2h;
    final norm h; LM head V·h unless tied (a critic or reward model replaces it with h·1).
    """
    h, head_dim = m.hidden, m.hidden // m.n_heads
    attn = 2 * h * h + 2 * h * head_dim * m.n_kv_heads
    layer = attn + 3 * h * m.intermediate + 2 * h
    body = m.vocab * h + m.n_layers * layer + h
    head = (0 if m.tie_embeddings else m.vocab * h) if with_lm_head else h
    return body + head


@dataclass
class Estimate:
    """GB per device for each phase, with the parts that make it up."""

    train: dict[str, float] = field(default_factory=dict)
    generate: dict[str, float] = field(default_factory=dict)

    @property
    def train_total(self) -> float:
        return sum(self.train.values())

    @property
    def generate_total(self) -> float:
        return sum(self.generate.values())


def trained_model_gb(params: int, shards: int, zero_stage: int, offload_optimizer: bool, dtype: str) -> dict[str, float]:
    """Weights, gradients and Adam state of a trained model on one device (Rajbhandari et al. 2020).

    Mixed precision keeps 16-bit weights (2P) and gradients (2P) plus fp32 master weights, momentum
    and variance (12P); pure fp32 keeps 4P + 4P + 8P. ZeRO-1 shards the optimizer state over the
    data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights.
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


def activations_gb(m: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """Activation memory of one micro-batch (Korthikanti et al. 2022, flash attention, no TP).

    Per layer s·b·h·34 bytes at 16 bits; with gradient checkpointing only each layer's input
    (2·s·b·h) is kept plus one layer recomputed. The fp32 logits and their gradient add 8·s·b·V.
    """
    sbh = seq_len * micro_batch * m.hidden
    scale = DTYPE_BYTES[m.dtype] / 2
    if m.gradient_checkpointing:
        layers = (2 * sbh * m.n_layers + 34 * sbh) * scale
    else:
        layers = 34 * sbh * m.n_layers * scale
    logits = 8 * seq_len * micro_batch * m.vocab
    return (layers + logits) / GB


def estimate(spec) -> Estimate:
    """Per-device memory of the busiest device, in the training and the generation phase."""
    m, train, pl, hw = spec.model, spec.train, spec.placement, spec.hardware
    seq = spec.rollout.max_prompt_tokens + spec.rollout.max_response_tokens
    layout = spec.layout
    est = Estimate()
    cuda = hw.accelerator == "cuda"
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    actor_ranks = layout.world_size("actor")
    tp = layout.rollout_tp
    vllm_share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb if "rollout" in spec.roles else 0.0

    train_parts: dict[str, float] = {}
    for part, gb in trained_model_gb(p_policy, actor_ranks, train.zero_stage, train.offload_optimizer, m.dtype).items():
        train_parts[f"actor {part}"] = gb
    train_parts["activations"] = activations_gb(m, spec.batch.micro_batch_size, seq)
    if "critic" in spec.roles:
        ranks = layout.world_size("critic")
        crit = trained_model_gb(p_value, ranks, train.zero_stage, train.offload_optimizer, m.dtype)
        train_parts["critic states"] = sum(crit.values())
    if "reference" in spec.roles:
        ranks = layout.world_size("reference")
        shard = ranks if train.zero_stage == 3 else 1
        train_parts["reference weights"] = DTYPE_BYTES[m.dtype] * p_policy / shard / GB
    if "reward" in spec.roles:
        ranks = layout.world_size("reward")
        shard = ranks if train.zero_stage == 3 else 1
        train_parts["reward model weights"] = DTYPE_BYTES[m.dtype] * p_value / shard / GB
    if cuda:
        train_parts["runtime"] = CUDA_OVERHEAD_GB

    gen_parts: dict[str, float] = {}
    if "rollout" in spec.roles:
        gen_parts["vLLM weights"] = DTYPE_BYTES[m.dtype] * p_policy / tp / GB if cuda else 0.0
        if cuda:
            gen_parts["vLLM KV cache + activations"] = max(vllm_share - gen_parts["vLLM weights"], 0.0)

    if pl.mode == "hybrid":
        # Both phases live on every device: what the idle side keeps resident is added to each phase.
        if "rollout" in spec.roles and cuda:
            train_parts["vLLM asleep" if pl.sleep_rollout else "vLLM (awake)"] = (
                VLLM_ASLEEP_GB if pl.sleep_rollout else vllm_share
            )
        if pl.offload_train_state:
            resident = 0.0
        else:
            resident = sum(v for k, v in train_parts.items() if k not in ("activations", "runtime") and "vLLM" not in k)
        if "rollout" in spec.roles:
            gen_parts["training state (resident)" if resident else "training state (offloaded)"] = resident
            if cuda:
                gen_parts["runtime"] = CUDA_OVERHEAD_GB
        est.train, est.generate = train_parts, gen_parts
        return est

    # Disaggregated: the busiest training device holds the actor; rollout devices hold vLLM only.
    est.train = {k: v for k, v in train_parts.items() if not k.startswith(("critic", "reference", "reward"))}
    if "rollout" in spec.roles and cuda:
        gen_parts["runtime"] = CUDA_OVERHEAD_GB
    est.generate = gen_parts
    return est


def role_memory_gb(spec, est: Estimate) -> dict[str, float]:
    """Disaggregated plans: GB per device for each role's own devices."""
    m, train = spec.model, spec.train
    out = {"actor": est.train_total}
    for role, params in (("critic", param_count(m, False)), ("reference", param_count(m)), ("reward", param_count(m, False))):
        if role not in spec.roles:
            continue
        ranks = spec.layout.world_size(role)
        if role == "critic":
            gb = sum(trained_model_gb(params, ranks, train.zero_stage, train.offload_optimizer, m.dtype).values())
            gb += activations_gb(m, spec.batch.micro_batch_size, spec.rollout.max_prompt_tokens + spec.rollout.max_response_tokens)
        else:
            shard = ranks if train.zero_stage == 3 else 1
            gb = DTYPE_BYTES[m.dtype] * params / shard / GB
        out[role] = gb + (CUDA_OVERHEAD_GB if spec.hardware.accelerator == "cuda" else 0.0)
    if "rollout" in spec.roles:
        out["rollout"] = est.generate_total
    return out
