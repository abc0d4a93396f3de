"""Per-device memory estimate of a run. Every formula here is written out in docs/memory.md.

All figures are GB (1e9 bytes). Estimates, not measurements: they aim to catch plans that cannot
fit and to show where the memory goes, not to predict the allocator to the megabyte. The
training figures are calibrated against peaks measured on an H200 (docs/memory.md, "measured vs
planned").

Hybrid placement (one pool of every role) has two phases on every GPU (training, generation);
otherwise there is one figure per pool of roles that share devices (disaggregated: per role,
``actor``; a placement whose actor and reference share: ``actor + reference``), for one of its GPUs. ``estimate`` returns both kinds as
``{name: {part: GB}}`` so the plan and the tests read them the same way, and the host memory of
the busiest node as ``Estimate.host`` (GPU runs whose hardware states its host memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlhf.rollout import registry as engines
from rlhf.spec.runspec import RunSpec
from rlhf.spec.schema import ModelSpec

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Runtime overhead per GPU process: CUDA context, NCCL buffers, cuBLAS workspace.
CUDA_OVERHEAD_GB = 2.0
# Plans above this share of device memory are reported as not fitting.
FIT_MARGIN = 0.95
# What PyTorch's caching allocator and DeepSpeed reserve beyond the tensors listed, as a share of
# them (block rounding, DeepSpeed's small buffers). Measured on an H200 at Qwen2.5-1.5B, 32,768-token
# micro-batches, everything resident: the actor process's typical reserved peak 111.5 GB against its
# 106.5 GB of listed parts (+4.7 %), of which 2.5 GB already in the resident states (28.2 GB against
# 25.7 GB). Steps whose reserved peak went far higher (up to 146.7 GB) did so while the device had
# room: the allocator takes new segments before reusing freed ones of the wrong size, and releases
# them when memory runs short; the allocated peaks (now logged) tell those apart (docs/memory.md).
ALLOCATOR_SLACK = 0.05
# parts that are not the training processes' tensors: no slack on them (nor on the rollout
# engines' parts, which their kinds name: rlhf.rollout.registry.EngineKind.memory_parts)
NO_SLACK = ("runtime",)
# Bytes a Qwen2/Llama decoder layer keeps per token for the backward pass at 16 bits, as
# a·h + b·I + c·kv + d·heads (kv = h/H·K), with HF's own layers: two RMSNorms at 8h each (the fp32
# upcast 4h, the normalised bf16 2h, the scaled output 2h); attention 4h + 4·kv + 4·heads (q and the
# output 2h each, k and v 2·kv each, FlashAttention's fp32 log-sum-exp per head); the SwiGLU MLP 8I
# (gate, up, SiLU(gate), their product). Measured with saved-tensor hooks (tests/spec/test_spec_activations.py).
ACT_BYTES_PER_LAYER = (20, 8, 4, 4)
# The same with Liger's kernels (model.liger_kernels true): its fused RMSNorm keeps only its bf16
# input (4h per norm with the scaled output the projections keep, not 8h) and its SwiGLU recomputes
# SiLU(gate) in the backward (6I, not 8I). Measured on an H200 at Qwen2.5-1.5B's shape: 2.0 MB per
# extra token of a micro-batch, which (12h + 6I + 4kv + 4H)·L + 4h = 2.06 MB predicts (docs/memory.md).
ACT_BYTES_PER_LAYER_LIGER = (12, 6, 4, 4)
# The final norm before the head, once per model: with HF's norm 8h per token (the fp32 upcast,
# the normalised bf16 and the rows the head reads); Liger's fused norm keeps only its input, so 2h
# plus those rows' 2h (the response positions' hidden states, which the log-prob pass keeps).
ACT_BYTES_FINAL_NORM = 8
ACT_BYTES_FINAL_NORM_LIGER = 4
# Log-probs and entropy come from the hidden states in chunks of rows, chunk // V rows of chunk
# logits at a time: the code's rlhf.algos.logprobs.CHUNK_ELEMENTS on CPU and CUDA_CHUNK_ELEMENTS
# on a GPU (rlhf.spec imports no torch: a test keeps the two pairs equal).
LOGITS_CHUNK = 2**26
CUDA_LOGITS_CHUNK = 2**28
# A plain linear head (any run below ZeRO-3 whose head has no LoRA adapter) takes the written-out
# backward. It keeps the micro-batch's [t, V] logits (b B each) from the forward when t·V is at
# most KEEP_LOGITS on CPU, CUDA_KEEP_LOGITS on a GPU (the code's rlhf.algos.logprobs.KEEP_ELEMENTS
# and CUDA_KEEP_ELEMENTS); each chunk's gradient is then written over its logits. Its working set
# per logit of a chunk: compiled (train.compile_logprobs, GPU) one bf16 scratch chunk, 2 B;
# eager a fp32 copy 4 B + the fp32 softmax of an entropy gradient 4 B (the result is written back
# into the kept logits in place).
KEEP_LOGITS = 2**28
CUDA_KEEP_LOGITS = 2**33
KEPT_CHUNK_BYTES_PER_LOGIT_COMPILED = 2
KEPT_CHUNK_BYTES_PER_LOGIT = 8
# ... plus the head's weight gradient from one matmul over the micro-batch, b B per weight, when
# the head trains (not under LoRA, whose head is frozen).
# Past the limit the forward keeps per-row statistics only, and the backward recomputes each
# chunk; its eager working set per logit of a chunk is its bf16 logits 2 B + one fp32 copy 4 B +
# the fp32 softmax of an entropy gradient 4 B + the previous chunk's bf16 gradient 2 B (the forward
# needs 6 B), and the head's weight gradient is summed over the chunks in fp32 (4 B per weight).
LINEAR_CHUNK_BYTES_PER_LOGIT = 12
HEAD_GRAD_BYTES = 4
# Any other head (ZeRO-3-partitioned, LoRA-adapted) goes through autograd, each chunk checkpointed:
# one chunk's fp32 logits, softmax and their gradients (4 B each) and the bf16 head output (2 B).
CHUNK_BYTES_PER_LOGIT = 18
# A forward-only pass (reference, reward model, critic values) keeps one chunk of bf16 and fp32
# logits and the log-sum-exp's fp32 temporaries: 14 B per logit of one chunk.
FORWARD_CHUNK_BYTES_PER_LOGIT = 14
# DeepSpeed ZeRO's defaults (0.19): gradients are reduced through a bucket of reduce_bucket_size
# elements in the training dtype (allocated whole, whatever the model's size); ZeRO-3 also
# prefetches stage3_prefetch_bucket_size elements of gathered weights.
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_PREFETCH_BUCKET = 50_000_000
# The optimizer step of ZeRO-1/2 in 16 bits flattens the gradient partition (b bytes per trained
# parameter) and casts it to fp32 (4 bytes). The activations' freed blocks cannot hold these
# large buffers, so the caching allocator reserves them on top of the backward's peak.
STEP_BYTES_FP32 = 4
# The training figures (hybrid's training phase, or a training role's GPU).
TRAINING_FIGURES = ("training phase", "actor", "critic", "reference", "teacher", "reward")


def training_figure(name: str) -> bool:
    """A training figure: hybrid's training phase, a training role's, or a pool of them (``actor + reference``)."""
    return name in TRAINING_FIGURES or all(part in TRAINING_FIGURES[1:] for part in name.split(" + "))

# ---- host memory (per node)
HOST = "host memory"
# Plans above this share of a node's memory do not fit (the OS, page cache and Ray's object
# store need the rest; Ray kills workers above 95 %).
HOST_FIT_MARGIN = 0.90
# Host memory of each process: a GPU worker (Python, torch, CUDA context and DeepSpeed); the
# driver with Ray's own processes. A rollout engine's is its kind's (EngineKind.host_gb).
HOST_PROCESS_GB = 4.0
HOST_DRIVER_GB = 4.0
# ZeRO-Offload keeps fp32 master weights, Adam's m and v and fp32 gradients on the host.
HOST_OFFLOAD_BYTES = 16
# Loading a model: a trained role's process reads it in float32 before DeepSpeed casts and moves
# it; a frozen model (reference, reward) loads in the training dtype.
HOST_LOAD_TRAINED_BYTES = 4


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


def layer_param_count(m: ModelSpec) -> int:
    """Parameters of one decoder layer (see ``param_count``)."""
    h = m.hidden
    return 2 * h * h + 2 * h * (h // m.n_heads) * m.n_kv_heads + 3 * h * m.intermediate + 2 * h


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


def zero_buffers_gb(m: ModelSpec, trained: int, shards: int, zero_stage: int, offload_optimizer: bool) -> dict[str, float]:
    """DeepSpeed's working memory beside the states of one trained model on one device.

    ``buffers``: the gradient reduce bucket, ZERO_REDUCE_BUCKET elements in the training dtype
    (ZeRO ≥ 1); at ZeRO-3 also the gathered weights in use: two layers (the current and the
    prefetched one), the embedding or head, and the prefetch bucket.
    ``step``: the optimizer step's flat gradient copy and its fp32 cast, (b + 4)·P_trained / N,
    when the optimizer is on the GPU and the model trains in 16 bits (ZeRO ≥ 1; at ZeRO-0 the
    fp32 cast alone).
    """
    b = DTYPE_BYTES[m.dtype]
    n = max(shards, 1)
    buffers = b * ZERO_REDUCE_BUCKET if zero_stage >= 1 else 0.0
    if zero_stage >= 3:
        buffers += b * (2 * layer_param_count(m) + m.vocab * m.hidden + ZERO3_PREFETCH_BUCKET)
    step = 0.0
    if b == 2 and not offload_optimizer:
        step = ((b if zero_stage >= 1 else 0) + STEP_BYTES_FP32) * trained / n
    return {"ZeRO buffers": buffers / GB, "optimizer step": step / GB}


def frozen_model_gb(params: int, shards: int, zero_stage: int, dtype: str) -> float:
    """A model that only runs forward (reference, reward model): its weights, sharded at ZeRO-3."""
    return DTYPE_BYTES[dtype] * params / (max(shards, 1) if zero_stage >= 3 else 1) / GB


def liger(m: ModelSpec) -> bool:
    """Whether the model runs Liger's kernels: ``model.liger_kernels`` resolved to True (auto is
    resolved before a plan; an unresolved value counts as off)."""
    return m.liger_kernels is True


def logits_chunk(accelerator: str) -> int:
    """Logits per log-prob chunk on this accelerator (rlhf.algos.logprobs' chunk sizes)."""
    return CUDA_LOGITS_CHUNK if accelerator == "cuda" else LOGITS_CHUNK


def keep_logits(accelerator: str) -> int:
    """The most logits a plain head keeps for its backward on this accelerator (rlhf.algos.logprobs'
    limits)."""
    return CUDA_KEEP_LOGITS if accelerator == "cuda" else KEEP_LOGITS


def layer_activation_bytes(m: ModelSpec) -> float:
    """Bytes one decoder layer keeps per token for the backward pass: a·h + b·I + c·kv + d·heads
    (ACT_BYTES_PER_LAYER, or ACT_BYTES_PER_LAYER_LIGER with Liger's kernels; at 16 bits, float32
    weights double it)."""
    a, b, c, d = ACT_BYTES_PER_LAYER_LIGER if liger(m) else ACT_BYTES_PER_LAYER
    kv = m.hidden // m.n_heads * m.n_kv_heads
    return (a * m.hidden + b * m.intermediate + c * kv + d * m.n_heads) * DTYPE_BYTES[m.dtype] / 2


def activations_gb(m: ModelSpec, tokens: int) -> float:
    """Activation memory of the decoder for one training micro-batch of ``tokens`` packed tokens.

    t·L·layer_activation_bytes + the final norm's 8h·t (4h·t with Liger's kernels); with gradient
    checkpointing each layer keeps only its input (2h·t) and one layer at a time is recomputed with
    its full activations.
    """
    per_layer = layer_activation_bytes(m) * tokens
    scale = DTYPE_BYTES[m.dtype] / 2
    final = (ACT_BYTES_FINAL_NORM_LIGER if liger(m) else ACT_BYTES_FINAL_NORM) * m.hidden * tokens * scale
    if m.gradient_checkpointing:
        layers = 2 * m.hidden * tokens * m.n_layers * scale + per_layer
    else:
        layers = per_layer * m.n_layers
    return (layers + final) / GB


def logprob_pass_gb(m: ModelSpec, tokens: int, chunk: int, zero_stage: int, keep: int = 0,
                    compiled: bool = False) -> float:
    """The policy's log-prob and entropy pass with gradients over a micro-batch of ``tokens``, with
    ``chunk`` logits per chunk (``logits_chunk``) and up to ``keep`` logits kept for the backward
    (``keep_logits``). A plain linear head whose t·V logits fit ``keep``:
    b·t·V + KEPT_CHUNK_BYTES_PER_LOGIT(_COMPILED)·min(t·V, chunk) + b·V·h (the weight gradient,
    not under LoRA); past ``keep``, the larger of that at ``keep`` logits (a micro-batch with fewer
    response tokens than ``tokens`` can still keep them) and the recomputing backward's
    LINEAR_CHUNK_BYTES_PER_LOGIT·min(t·V, chunk) + HEAD_GRAD_BYTES·V·h; a ZeRO-3-partitioned or
    LoRA-adapted head: CHUNK_BYTES_PER_LOGIT·min(t·V, chunk)."""
    logits = min(tokens * m.vocab, chunk)
    if zero_stage >= 3 or (m.lora.rank > 0 and "lm_head" in m.lora.target_modules):
        return CHUNK_BYTES_PER_LOGIT * logits / GB
    b, trains_head = DTYPE_BYTES[m.dtype], m.lora.rank <= 0
    per_logit = KEPT_CHUNK_BYTES_PER_LOGIT_COMPILED if compiled else KEPT_CHUNK_BYTES_PER_LOGIT
    kept = b * min(tokens * m.vocab, keep) + per_logit * logits + (b * m.vocab * m.hidden if trains_head else 0)
    if tokens * m.vocab <= keep:
        return kept / GB
    recomputed = LINEAR_CHUNK_BYTES_PER_LOGIT * logits + (HEAD_GRAD_BYTES * m.vocab * m.hidden if trains_head else 0)
    return max(kept, recomputed) / GB


def forward_pass_gb(m: ModelSpec, tokens: int, chunk: int, lm_head: bool = True) -> float:
    """A forward-only pass (reference log-probs, critic values, reward scores) over ``tokens``:
    one layer's activations at a time, and with an LM head one chunk of ``chunk`` logits
    (FORWARD_CHUNK_BYTES_PER_LOGIT each)."""
    layer = layer_activation_bytes(m) * tokens
    logits = FORWARD_CHUNK_BYTES_PER_LOGIT * min(tokens * m.vocab, chunk) if lm_head else 0
    return (layer + logits) / GB


@dataclass
class Estimate:
    """GB per device: ``figures[name][part]``. Hybrid names: "training phase", "generation phase";
    disaggregated names: the roles ("actor", "critic", "reference", "reward", "rollout").
    ``host``: GB of host memory on the busiest node, by part (empty when not checked: CPU runs)."""

    mode: str
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def total(self, name: str) -> float:
        return sum((self.host if name == HOST else self.figures[name]).values())

    @property
    def totals(self) -> dict[str, float]:
        """Every GPU figure's total (host memory not included: see ``over_limit``)."""
        return {k: self.total(k) for k in self.figures}


def capacity(spec: RunSpec, name: str) -> float:
    """What figure ``name`` may use and still fit: FIT_MARGIN of a GPU, or HOST_FIT_MARGIN of a
    node's host memory."""
    if name == HOST:
        return spec.hardware.host_memory_gb * HOST_FIT_MARGIN
    return spec.hardware.device_memory_gb * FIT_MARGIN


# The start-up check of hardware.device_memory_gb against the device (``device_memory_mismatch``):
# vLLM reserves gpu_memory_utilization of the device's true total, so a file that states GiB
# (141 for an H200, whose CUDA total is 150.7 GB) under-plans vLLM's share by u · 9.7 GB.
DEVICE_MEMORY_TOLERANCE = 0.03


def _stated_against_gpu(stated: float, total_bytes: int) -> tuple[str, float]:
    """The opening both start-up lines share (the stated figure against CUDA's total), and the fix:
    the total rounded down to 0.1 GB, as the shipped hardware files state it."""
    measured = total_bytes / GB
    return (f"hardware.device_memory_gb={stated:g} but this GPU's total is {measured:.2f} GB "
            f"({total_bytes / 2**30:.1f} GiB, as CUDA reports it)", math.floor(measured * 10) / 10)


def device_memory_mismatch(spec: RunSpec, total_bytes: int) -> str | None:
    """One warning line when ``total_bytes``, a GPU's total as CUDA reports it, differs from
    ``hardware.device_memory_gb`` by more than DEVICE_MEMORY_TOLERANCE of it; None when it agrees."""
    stated = spec.hardware.device_memory_gb
    if abs(total_bytes / GB - stated) <= DEVICE_MEMORY_TOLERANCE * stated:
        return None
    opening, fix = _stated_against_gpu(stated, total_bytes)
    return (f"{opening}: the plan's figures and vLLM's share (rollout.gpu_memory_utilization of the true "
            f"total) disagree; set hardware.device_memory_gb={fix:g}.")


def device_memory_refusal(spec: RunSpec, total_bytes: int) -> str | None:
    """One error line when the GPU (``total_bytes``, CUDA's total) is smaller than
    ``hardware.device_memory_gb`` by more than DEVICE_MEMORY_TOLERANCE and the plan, estimated again
    at the GPU's true total (vLLM's share of it included), does not fit it: the plan's choices
    (token budget, resident states, kept logits) were made for a larger GPU, and such a run thrashes
    the allocator or runs out of memory (a 1.5B run planned for 150.7 GB on an 85-GB H100: update
    5× slower, BENCHMARKS §8). None otherwise: a larger GPU, or a smaller one the plan still fits,
    gets ``device_memory_mismatch``'s warning."""
    stated, measured = spec.hardware.device_memory_gb, total_bytes / GB
    if measured >= stated * (1 - DEVICE_MEMORY_TOLERANCE):
        return None
    real = replace(spec, hardware=replace(spec.hardware, device_memory_gb=measured))
    # the GPU figures only: the host's does not depend on the GPU (and preflight refused it already)
    over = {k: v for k, v in over_limit(real, estimate(real)).items() if k != HOST}
    if not over:
        return None
    opening, fix = _stated_against_gpu(stated, total_bytes)
    figures = ", ".join(f"{k} {v:.1f} GB" for k, v in over.items())
    return (f"{opening}, and the plan made for {stated:g} GB does not fit it ({figures}; {FIT_MARGIN:.0%} of "
            f"{measured:.1f} GB usable): set hardware.device_memory_gb={fix:g} and the plan chooses for this GPU "
            f"(--plan shows it).")


def over_limit(spec: RunSpec, est: Estimate) -> dict[str, float]:
    """The figures that do not fit, ``{name: GB}`` (GPU figures, then "host memory"); none on CPU."""
    if spec.hardware.accelerator != "cuda":
        return {}
    out = {k: v for k, v in est.totals.items() if v > capacity(spec, k)}
    if est.host and est.total(HOST) > capacity(spec, HOST):
        out[HOST] = est.total(HOST)
    return out


def fits(spec: RunSpec, est: Estimate | None = None) -> bool:
    """Every GPU figure within FIT_MARGIN of a GPU and the host figure within HOST_FIT_MARGIN."""
    return not over_limit(spec, est or estimate(spec))


def estimate(spec: RunSpec) -> Estimate:
    """Per-device memory of a built spec, for each phase (hybrid) or role (disaggregated), and
    the host memory of the busiest node (GPU runs with ``hardware.host_memory_gb``)."""
    m, train, pl, hw, lay = spec.model, spec.train, spec.placement, spec.hardware, spec.layout
    tokens = train.max_tokens_per_micro_batch
    cuda = hw.accelerator == "cuda"
    runtime = {"runtime": CUDA_OVERHEAD_GB} if cuda else {}
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    z, off = train.zero_stage, train.offload_optimizer
    lm_head = spec.algo.kind != "rm"  # a reward model trains a value head
    chunk = logits_chunk(hw.accelerator)

    def states(role: str, params: int) -> dict[str, float]:
        parts = trained_model_gb(params, lay.world_size(role), z, off, m.dtype)
        return {f"{role} {k}": v for k, v in parts.items()}

    def buffers(role: str, trained: int) -> dict[str, float]:
        parts = zero_buffers_gb(m, trained, lay.world_size(role), z, off) if cuda else {}
        return {f"{role} {k}": v for k, v in parts.items()}

    p_lora = lora_param_count(m)
    # LoRA: the policy's base weights are frozen (DeepSpeed's offload moves none of them)
    lora_base = frozen_model_gb(p_policy, lay.world_size("actor"), z, m.dtype) if p_lora else 0.0
    if p_lora:  # gradients and Adam state only for the adapters
        actor = states("actor", p_lora)
        actor["actor weights"] += lora_base
    else:
        actor = states("actor", p_policy)
    actor_work = {**buffers("actor", p_lora or p_policy), "activations": activations_gb(m, tokens)}
    if lm_head:
        actor_work["log-prob pass"] = logprob_pass_gb(m, tokens, chunk, z, keep_logits(hw.accelerator),
                                                      compiled=cuda and spec.train.compile_logprobs is not False)
    has_critic = "critic" in spec.roles
    critic = states("critic", p_value) if has_critic else {}
    critic_work = {**buffers("critic", p_value), "critic activations": activations_gb(m, tokens)} if has_critic else {}
    # RL with LoRA: the reference is the policy with its adapters disabled, so on the actor's GPUs
    # (hybrid) it needs no weights of its own.
    shared_reference = p_lora > 0 and lay.one_pool and spec.algo.kind == "rl"
    has_reference = "reference" in spec.roles and not shared_reference
    reference = {"reference weights": frozen_model_gb(p_policy, lay.world_size("reference"), z, m.dtype)} \
        if has_reference else {}
    reward = {"reward model weights": frozen_model_gb(p_value, lay.world_size("reward"), z, m.dtype)} \
        if "reward" in spec.roles else {}
    # on-policy distillation's teacher: its own shape (rlhf.spec.shape.teacher_model), frozen like the reference
    tm = teacher_of(spec)
    teacher = {"teacher weights": frozen_model_gb(param_count(tm), lay.world_size("teacher"), z, m.dtype)} \
        if tm is not None else {}
    teacher_out = teacher_offloaded(spec)  # hybrid GPU: in host memory while the engines generate
    rollout = "rollout" in spec.roles
    engine = engines.kind(spec) if rollout else None

    est = Estimate(mode=pl.mode)
    if lay.one_pool:
        # Every GPU holds every role; one phase runs at a time. The actor's and the critic's
        # updates run at the same time, and each process keeps its cached blocks until the
        # phase ends (the reference's forward pass too), so all of them add up.
        frozen_work = {"reference pass": forward_pass_gb(m, tokens, chunk)} if has_reference and cuda else {}
        if teacher and cuda:
            frozen_work["teacher pass"] = forward_pass_gb(tm, tokens, chunk)
        # the reward model scores right after generation, vLLM awake, and its process keeps the
        # blocks until the next release before vLLM wakes: it counts in both phases
        reward_work = {"reward model pass": forward_pass_gb(m, tokens, chunk, lm_head=False)} if reward and cuda else {}
        frozen_work.update(reward_work)
        train_phase = {**actor, **critic, **reference, **teacher, **reward, **actor_work, **critic_work,
                       **frozen_work, **runtime}
        if spec.algo.kind == "dpo" and reference:
            # DPO's reference scores every pair once before the first update and is then released
            # (rlhf.loops.dpo): beside the actor's states, either it or the update's working set
            ref_phase = {**reference, **frozen_work}
            update = {k: v for k, v in {**actor, **actor_work}.items()
                      if k in ("activations", "log-prob pass", "actor optimizer step")}
            dropped = update if sum(ref_phase.values()) > sum(update.values()) else ref_phase
            train_phase = {k: v for k, v in train_phase.items() if k not in dropped}
        if rollout and cuda:
            train_phase.update(engine.resident_while_training(spec, p_policy))
        est.figures["training phase"] = train_phase
        # async rollouts on these GPUs: the engines generate during the update, so the training
        # phase holds both and generation alone (a part of it) is no figure of its own
        if rollout and not overlaps_update(spec):
            gen = engine.gpu_memory(spec, p_policy) if cuda else {}
            if pl.offload_train_state:
                # DeepSpeed moves what its optimizer holds (rlhf.workers.sync_cuda.TrainStates);
                # frozen weights stay: the reference's and the reward model's (rlhf.workers.schedule),
                # and with LoRA the policy's base weights
                kept = sum({**reference, **reward}.values()) + lora_base
                if kept:
                    gen["frozen weights (resident)"] = kept
            else:
                gen["training state (resident)"] = sum({**actor, **critic, **reference, **reward}.values())
            if teacher and not teacher_out:  # the teacher's weights stay unless algo.teacher.offload
                gen["teacher weights (resident)"] = teacher["teacher weights"]
            gen.update(reward_work)
            gen.update(runtime)
            est.figures["generation phase"] = gen
    else:
        # Disaggregated: each role on its own GPUs; a figure for one GPU of each.
        est.figures["actor"] = {**actor, **actor_work, **runtime}
        if critic:
            est.figures["critic"] = {**critic, **critic_work, **runtime}
        if reference:
            est.figures["reference"] = {**reference, "reference pass": forward_pass_gb(m, tokens, chunk), **runtime}
        if teacher:
            est.figures["teacher"] = {**teacher, "teacher pass": forward_pass_gb(tm, tokens, chunk), **runtime}
        if reward:
            est.figures["reward"] = {**reward, "reward model pass": forward_pass_gb(m, tokens, chunk, lm_head=False),
                                     **runtime}
        if rollout:
            est.figures["rollout"] = {**(engine.gpu_memory(spec, p_policy) if cuda else {}), **runtime}
        for pool in lay.pools:  # roles that share devices: one figure, their parts added up
            if len(pool) > 1:
                shared: dict[str, float] = {}
                for r in pool:
                    for k, v in est.figures.pop(r, {}).items():
                        shared[k] = v if k == "runtime" else shared.get(k, 0.0) + v
                est.figures[" + ".join(pool)] = shared
    if cuda:
        est.figures = {name: with_slack(parts, no_slack(spec)) for name, parts in est.figures.items()}
        if hw.host_memory_gb > 0:
            est.host = host_gb(spec)
    return est


def teacher_of(spec: RunSpec) -> ModelSpec | None:
    """On-policy distillation's teacher as a ``ModelSpec`` (its architecture numbers), None without one."""
    if "teacher" not in spec.roles:
        return None
    from rlhf.spec.shape import teacher_model

    return teacher_model(spec.model, spec.algo.teacher)


def teacher_offloaded(spec: RunSpec) -> bool:
    """The teacher's weights wait in host memory while the engines generate (``algo.teacher.offload``):
    hybrid placement on GPU, the teacher not ZeRO-3-partitioned (``rlhf.workers.frozen.TeacherWorker``)."""
    return ("teacher" in spec.roles and spec.algo.teacher.offload and spec.hardware.accelerator == "cuda"
            and spec.layout.rollout_beside_training and spec.train.zero_stage != 3)


def smaller_shares(spec: RunSpec, weights: float) -> list[float]:
    """rollout.gpu_memory_utilization values below the current one, in tenths, largest first, that
    leave at least half of the share to the KV cache beside vLLM's ``weights`` (GB per GPU)."""
    u, mem = spec.rollout.gpu_memory_utilization, spec.hardware.device_memory_gb
    return [t / 10 for t in range(math.ceil(u * 10) - 1, 0, -1) if weights <= t / 10 * mem / 2]


def overlaps_update(spec: RunSpec) -> bool:
    """On GPU, the rollout engines generate during the update on the trained roles' devices
    (``algo.async_steps`` > 0 in a placement that shares them): they stay awake through the training
    phase (``placement.sleep_rollout`` auto resolves to false), whose figure then holds both at once."""
    return (getattr(spec.algo, "async_steps", 0) > 0 and "rollout" in spec.roles
            and spec.hardware.accelerator == "cuda" and spec.layout.rollout_beside_training)


def no_slack(spec: RunSpec) -> tuple[str, ...]:
    """The parts no allocator slack is added to: the runtime and the rollout engine's parts."""
    return NO_SLACK + (engines.kind(spec).memory_parts() if "rollout" in spec.roles else ())


def with_slack(parts: dict[str, float], exempt: tuple[str, ...] = NO_SLACK) -> dict[str, float]:
    """``parts`` with "allocator slack" (ALLOCATOR_SLACK of the training processes' tensors)
    before the ``exempt`` parts (the runtime, the rollout engine's)."""
    tensors = {k: v for k, v in parts.items() if k not in exempt}
    if not tensors:
        return dict(parts)
    rest = {k: v for k, v in parts.items() if k in exempt}
    return {**tensors, "allocator slack": ALLOCATOR_SLACK * sum(tensors.values()), **rest}


# ----------------------------------------------------------------------------- host memory


def _per_node(devices: tuple[int, ...], per_node: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for d in devices:
        out[d // per_node] = out.get(d // per_node, 0) + 1
    return out


def host_gb(spec: RunSpec) -> dict[str, float]:
    """Host memory of the busiest node, by part (GB):

    * ``runtime``: HOST_PROCESS_GB per GPU worker process (one per role per GPU it spans),
      what the rollout engine's kind says per engine (vLLM: HOST_VLLM_ENGINE_GB plus
      HOST_PROCESS_GB per further TP worker; HF: HOST_PROCESS_GB), and
      HOST_DRIVER_GB for the driver and Ray;
    * ``model loading``: each trained role's process reads its model in float32 (4 B/param),
      each frozen one in the training dtype; counted whole although a load is over once DeepSpeed
      has moved the model, since the roles start at the same time;
    * ``optimizer (offloaded)``: ZeRO-Offload's fp32 master weights, m, v and fp32 gradients,
      16 B per trained parameter of each rank's partition, summed over the node's ranks;
    * ``training states (offloaded)`` (placement.offload_train_state, runs that generate): what
      DeepSpeed's ``offload_states`` moves for each trained role's rank while vLLM generates: its
      weights, gradients, optimizer state (when not offloaded already) and reduce bucket.
    """
    m, train, pl, hw, lay = spec.model, spec.train, spec.placement, spec.hardware, spec.layout
    per_node = hw.devices_per_node
    nodes = max(hw.nodes, 1)
    b = DTYPE_BYTES[m.dtype]
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    p_lora = lora_param_count(m)
    trained = {"actor": p_lora or p_policy, "critic": p_value}
    tm = teacher_of(spec)
    full = {"actor": p_policy, "critic": p_value, "reference": p_policy, "reward": p_value,
            "teacher": param_count(tm) if tm is not None else 0}
    shared_reference = p_lora > 0 and lay.one_pool and spec.algo.kind == "rl"
    # ranks of each role and engine per node, counted once (not once per node: a plan of many nodes)
    role_ranks = {role: _per_node(devs, per_node) for role, devs in lay.roles.items()}
    engine_ranks = [_per_node(devs, per_node) for devs in lay.engines]
    best: dict[str, float] = {}
    for node in range(nodes):
        runtime = HOST_DRIVER_GB if node == 0 else 0.0
        load = offloaded = states = 0.0
        for role, devs in lay.roles.items():
            if role == "rollout":
                continue
            ranks = role_ranks[role].get(node, 0)
            if not ranks:
                continue
            runtime += HOST_PROCESS_GB * ranks
            if role in trained:
                load += HOST_LOAD_TRAINED_BYTES * full[role] * ranks
                n = len(devs)
                p = trained[role]
                if train.offload_optimizer:
                    offloaded += HOST_OFFLOAD_BYTES * p / n * ranks
                # hybrid's schedule moves them out around generation only (no rollout: never)
                if lay.rollout_beside_training and pl.offload_train_state is True and train.zero_stage >= 1:
                    # a LoRA policy's frozen base weights are not the optimizer's: they stay on the GPU
                    parts = trained_model_gb(p, n, train.zero_stage, train.offload_optimizer, m.dtype)
                    states += (sum(parts.values()) + b * ZERO_REDUCE_BUCKET / GB) * ranks * GB
            elif not (role == "reference" and shared_reference):
                load += b * full[role] * ranks
        for counts in engine_ranks:
            here = counts.get(node, 0)
            if here:
                runtime += engines.kind(spec).host_gb(spec, here, HOST_PROCESS_GB)
        parts = {"runtime": runtime, "model loading": load / GB}
        ranks = role_ranks.get("teacher", {}).get(node, 0)
        if ranks and teacher_offloaded(spec):  # the teacher's weights while the engines generate
            parts["teacher (offloaded)"] = b * full["teacher"] * ranks / GB
        if offloaded:
            parts["optimizer (offloaded)"] = offloaded / GB
        if states:
            parts["training states (offloaded)"] = states / GB
        if sum(parts.values()) > sum(best.values()):
            best = parts
    return best


# ----------------------------------------------------------------------------- advice


def min_gpus(spec: RunSpec, est: Estimate, name: str, offload_optimizer: bool | None = None) -> int:
    """About how many GPUs of this size a training figure (hybrid "training phase", or the actor,
    critic, reference or reward role) needs at ZeRO-3, where all model states and the optimizer
    step's buffers shard over the GPUs and activations, runtime and a sleeping engine do not. 0:
    the unsharded parts alone do not fit."""
    m = spec.model
    b = DTYPE_BYTES[m.dtype]
    off = spec.train.offload_optimizer if offload_optimizer is None else offload_optimizer
    step = (b + STEP_BYTES_FP32) if b == 2 and not off else 0
    trained = 2 * b + (0 if off else (12 if b == 2 else 8)) + step  # bytes per parameter
    p_policy, p_value = param_count(m), param_count(m, with_lm_head=False)
    hybrid = name == "training phase"
    pool = name.split(" + ")  # the roles of a figure (one, or a pool's)
    parts = est.figures[name]
    # DPO's training phase holds its reference or its update's working set (estimate): the side it kept
    one_side = hybrid and spec.algo.kind == "dpo" and "reference" in spec.roles
    actor_trained = trained - step if one_side and "actor optimizer step" not in parts else trained
    sharded = 0.0
    if hybrid or "actor" in pool:
        p_lora = lora_param_count(m)  # LoRA: frozen weights plus trained adapters
        sharded += b * p_policy + actor_trained * p_lora if p_lora else actor_trained * p_policy
    if (hybrid and "critic" in spec.roles) or "critic" in pool:
        sharded += trained * p_value
    shared_reference = lora_param_count(m) > 0 and spec.algo.kind == "rl"
    reference_kept = not one_side or "reference weights" in parts
    if (hybrid and "reference" in spec.roles and not shared_reference and reference_kept) or "reference" in pool:
        sharded += b * p_policy
    if (hybrid and "reward" in spec.roles) or "reward" in pool:
        sharded += b * p_value
    tm = teacher_of(spec)
    if tm is not None and (hybrid or "teacher" in pool):
        sharded += b * param_count(tm)
    # the unsharded parts are the current stage's (at ZeRO-2 the whole head's log-prob pass and
    # ZeRO-2's buffers, where ZeRO-3 would have its own): "about", as the docstring says
    fixed = sum(v for k, v in parts.items()
                if not k.endswith(("weights", "grads", "optimizer", "optimizer step")) and k != "allocator slack")
    # the slack grows with the sharded states too: room for (1 + slack) times them
    slack = ALLOCATOR_SLACK if "allocator slack" in parts else 0.0
    room = capacity(spec, name) - fixed - slack * (fixed - sum(parts.get(k, 0.0) for k in no_slack(spec)))
    return math.ceil(sharded * (1 + slack) / GB / room) if room > 0 else 0
