"""Typed schemas of every config group.

These dataclasses are registered in Hydra's ConfigStore (see ``register``), so composition already
rejects unknown keys and wrong types with the key path; ``rlhf.spec.build`` then merges a composed
config onto them again (so a saved run config rebuilds the same spec without Hydra), validates,
derives the batch plan and freezes the result.

A field exists only where code reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class Frozen:
    """Mixin: instances refuse attribute writes once ``freeze`` has run (workers must not mutate)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(
                f"the run spec is frozen: cannot set {type(self).__name__}.{name}; "
                "change the config instead"
            )
        object.__setattr__(self, name, value)


# --------------------------------------------------------------------------- algo


@dataclass
class KLSpec(Frozen):
    coef: float = 0.0
    estimator: str = "k3"  # k1 | k2 | k3, or one registered by algo.plugins (rlhf.algos.registry)
    placement: str = "loss"  # loss | reward
    adaptive: bool = False  # adaptive controller (Ziegler et al. 2019), only in reward
    target: float = 6.0
    horizon: int = 10000
    clamp: float = 10.0


@dataclass
class CriticSpec(Frozen):
    lr: float = 1e-5
    value_clip: float = 0.2
    warmup_steps: int = 0


@dataclass
class RLAlgo(Frozen):
    """PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline."""

    name: str = MISSING
    kind: str = "rl"
    # advantage estimator (rlhf.algos.registry): gae | grpo | dr_grpo | rloo | reinforce_pp |
    # reinforce_pp_baseline, or one registered by algo.plugins
    estimator: str = MISSING
    policy_loss: str = "clip"  # clip (PPO's clipped surrogate), or one registered by algo.plugins
    # modules imported in the driver and the workers before the parts above are looked up: their
    # decorators register more estimators, policy losses and KL estimators (rlhf.algos.registry)
    plugins: list[str] = field(default_factory=list)
    group_size: int = 1  # samples per prompt
    normalize_std: bool = True  # GRPO: divide by the group's std
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True  # gae: scale advantages to mean 0, std 1 over the batch (off: raw GAE)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    ratio_level: str = "token"  # token | sequence (GSPO)
    loss_agg: str = "token_mean"
    tis_cap: Optional[float] = None  # truncated importance sampling of rollout vs trainer logprobs
    async_steps: int = 0  # rollouts of the next k steps overlap the update (staleness <= k); 0 = off
    entropy_coef: float = 0.0
    kl: KLSpec = field(default_factory=KLSpec)
    critic: Optional[CriticSpec] = None
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    epochs: int = 1  # passes over each rollout batch
    mini_batch_size: Optional[int] = None  # samples per optimizer step (global); None = whole batch
    overlong_buffer: Optional[int] = None  # DAPO soft overlong penalty window, in tokens
    overlong_penalty: float = 1.0
    reward_clip: Optional[float] = None
    reward_normalize: bool = False
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal


@dataclass
class DPOAlgo(Frozen):
    name: str = "dpo"
    kind: str = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0  # cDPO
    reference_free: bool = False
    lr: float = 5e-7
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    epochs: int = 1
    eval_fraction: float = 0.1
    packing: bool = False  # pack chosen/rejected sequences of a micro-batch into shared rows


@dataclass
class RMAlgo(Frozen):
    name: str = "rm"
    kind: str = "rm"
    margin: Optional[float] = None
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    epochs: int = 1
    eval_fraction: float = 0.1
    packing: bool = False  # pack chosen/rejected sequences of a micro-batch into shared rows


@dataclass
class SFTAlgo(Frozen):
    name: str = "sft"
    kind: str = "sft"
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    epochs: int = 1
    eval_fraction: float = 0.1
    packing: bool = False


ALGO_SCHEMAS = {"rl": RLAlgo, "dpo": DPOAlgo, "rm": RMAlgo, "sft": SFTAlgo}


# --------------------------------------------------------------------------- model


# The linear projections of a Llama/Qwen decoder layer (attention and MLP): LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSpec(Frozen):
    """LoRA adapters on the policy (Hu et al. 2021): each target Linear W trains W + (alpha/rank)·B·A
    with W frozen; the rollout engines and the HF export get the merged weights (rlhf.models.lora)."""

    rank: int = 0  # r of A (r × in) and B (out × r); 0 = off, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # Linear module names


@dataclass
class ModelSpec(Frozen):
    """A model: where to load it and the architecture numbers that memory planning needs."""

    name: str = MISSING
    path: str = MISSING  # local HF checkpoint dir, Hugging Face Hub id (org/name), or builtin:<name>
    revision: Optional[str] = None  # a Hub id's branch, tag or commit; None = main
    n_layers: int = MISSING
    hidden: int = MISSING
    intermediate: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    vocab: int = MISSING
    tie_embeddings: bool = False
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32
    gradient_checkpointing: bool = False
    # GPU: Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the training-side models (fewer,
    # fused elementwise passes; the log-probs are chunked by rlhf.algos.logprobs either way)
    liger_kernels: bool = False
    lora: LoraSpec = field(default_factory=LoraSpec)  # rank > 0: train LoRA adapters, not the policy's weights


# --------------------------------------------------------------------------- hardware


@dataclass
class HardwareSpec(Frozen):
    name: str = MISSING
    accelerator: str = "cuda"  # cuda | cpu
    nodes: int = 1
    devices_per_node: int = 1  # GPUs, or CPU worker slots when accelerator=cpu
    device_memory_gb: float = 0.0
    peak_bf16_tflops: float = 0.0
    # host memory of one node (GB): the plan checks what the run keeps there (offloaded optimizer
    # and training states, model loading, processes); 0 = not checked
    host_memory_gb: float = 0.0


# --------------------------------------------------------------------------- placement


@dataclass
class RolloutPlacement(Frozen):
    engines: int = 1
    tensor_parallel: int = 1


@dataclass
class PlacementSpec(Frozen):
    """hybrid: every role spans the same devices; disaggregated: each role gets its own."""

    mode: str = MISSING  # hybrid | disaggregated
    # disaggregated only: devices per training role (0 = role not used or not placed)
    actor: int = 0
    critic: int = 0
    reference: int = 0
    reward: int = 0
    rollout: RolloutPlacement = field(default_factory=RolloutPlacement)
    # hybrid only: the switches that let training and generation share a GPU
    sleep_rollout: bool = True
    # DeepSpeed's states leave the GPU while vLLM generates. auto: they stay when the plan's generation
    # phase fits with them resident (rlhf.spec.auto), since moving them costs time every step.
    offload_train_state: Any = "auto"  # auto | true | false (checked by validation)


# --------------------------------------------------------------------------- rollout / train


@dataclass
class RolloutSpec(Frozen):
    engine: str = "auto"  # auto | hf | vllm (auto: vllm on cuda, hf on cpu)
    max_prompt_tokens: int = 64
    max_response_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    gpu_memory_utilization: float = 0.5  # vLLM's share of each GPU
    enforce_eager: bool = False
    # a seed per prompt (derived from train.seed, the step and the prompt's place), so a step's
    # samples can be drawn again. null = auto: on with HF generate; off with vLLM, whose sampler
    # draws seeded requests one by one (a kernel per request per token) instead of in one batch
    seeded: Optional[bool] = None


@dataclass
class TrainSpec(Frozen):
    steps: int = 100
    prompts_per_step: int = 16
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    # Tokens per packed forward/backward on one rank (the RL passes pack samples up to this budget);
    # None = micro_batch_size × (rollout.max_prompt_tokens + rollout.max_response_tokens). The built
    # spec always holds an int.
    max_tokens_per_micro_batch: Optional[int] = None
    # 0-3, or auto: the spec build picks from the plan's memory figures (rlhf.spec.auto): ZeRO-3
    # only when several ranks share the model and ZeRO-2 does not fit; 0 on CPU. The built spec holds an int.
    zero_stage: Any = "auto"  # auto | 0-3 (checked by validation)
    seed: int = 0
    # Adam's state in host memory (DeepSpeed's CPU Adam); auto: on only when the training figure does
    # not fit otherwise. The built spec holds a bool.
    offload_optimizer: Any = "auto"  # auto | true | false (checked by validation)


# --------------------------------------------------------------------------- data / reward / tracking


@dataclass
class DataSpec(Frozen):
    name: str = MISSING
    # paths, builtin:<task>/<split>, or Hub data sets: hub:<org>/<name>[@<revision>][:<config>]:<split>
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None  # mixing weights, one per train file
    prompt_key: str = "prompt"
    response_key: str = "response"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    messages_key: str = "messages"
    columns: list[str] = field(default_factory=list)  # renames in every file's rows, old:new, e.g. [question:prompt]
    chat_template: bool = False  # render prompts with the tokenizer's chat template
    # sft/rm/dpo: tokens per example (prompt + response); None = rollout.max_prompt_tokens + max_response_tokens
    max_length: Optional[int] = None
    truncation: str = "right"  # sft/rm/dpo, examples over max_length: right | left (cut the prompt's start) | drop
    shuffle: bool = True


@dataclass
class RewardFnSpec(Frozen):
    fn: str = MISSING  # module:function or path/to/file.py:function
    weight: float = 1.0
    name: Optional[str] = None


@dataclass
class RemoteRewardSpec(Frozen):
    """An HTTP reward service (``rlhf-reward-server`` or anything speaking ``rlhf.rewards.remote``)."""

    urls: list[str] = field(default_factory=list)  # http://host:port, requests spread round-robin
    weight: float = 1.0
    name: str = "remote"  # the part's name in metrics (reward/<name>/mean)
    batch_size: int = 64  # samples per request
    concurrency: int = 4  # requests in flight
    timeout_s: float = 60.0  # per request
    retries: int = 3  # extra attempts per request (next URL, exponential backoff)


@dataclass
class RewardSpec(Frozen):
    name: str = MISSING
    functions: list[RewardFnSpec] = field(default_factory=list)
    remote: Optional[RemoteRewardSpec] = None  # a reward service, scored beside the functions
    model_path: Optional[str] = None  # a reward model checkpoint (scalar head): local dir or Hub id
    model_revision: Optional[str] = None  # model_path's branch, tag or commit when it is a Hub id
    model_weight: float = 1.0
    timeout_s: float = 60.0


@dataclass
class TrackingSpec(Frozen):
    backend: str = "mlflow"  # mlflow | none
    uri: Optional[str] = None  # None: a sqlite store under the output root
    experiment: str = "rlhf"
    console: str = "rich"  # rich | plain | none
    log_every: int = 1
    # what a sweep (-m) returns to Hydra's sweeper, e.g. Optuna's objective: this metric's mean over
    # the last fifth of the steps that logged it (reward/mean, eval/greedy/reward_mean, ...)
    objective: str = "reward/mean"


@dataclass
class CheckpointSpec(Frozen):
    every: int = 0  # steps; 0 = only at the end (and at a stop by Ctrl-C / SIGTERM)
    keep_last: int = 2
    save_hf: bool = True  # an HF-format export of each trained role inside every checkpoint
    best_metric: Optional[str] = None  # e.g. eval/greedy/reward_mean: its best (highest) checkpoint survives rotation


@dataclass
class EvalSpec(Frozen):
    """RL evaluation on data.eval_files (rlhf.loops.rl_eval): greedy and sampled, per data source."""

    every: int = 0  # steps between evaluations (and after the last step); 0 = off
    n_samples: int = 4  # sampled responses per prompt: pass@n_samples
    pass_threshold: float = 1.0  # a response passes when its reward is >= this
    max_prompts: Optional[int] = None  # the first N eval prompts; None = all
    # also evaluate the starting policy before the first step (logged with step 1 as eval_before/...)
    before_training: bool = False


@dataclass
class EnvSpec(Frozen):
    """A multi-turn environment (rlhf.envs): the model and the environment take turns."""

    fn: Optional[str] = None  # module:Class (reset(row), step(response) -> feedback, reward, done); None = single turn
    max_turns: int = 1  # model turns per episode (at most)


@dataclass
class RaySpec(Frozen):
    address: Optional[str] = None  # join an existing cluster ("auto" or host:port); None starts a local one
    num_cpus: Optional[int] = None


# --------------------------------------------------------------------------- root


@dataclass
class RunConfig:
    """The root schema; ``algo`` is typed by its group file (RLAlgo, DPOAlgo, ...)."""

    algo: Any = MISSING
    model: ModelSpec = MISSING
    hardware: HardwareSpec = MISSING
    placement: PlacementSpec = MISSING
    data: DataSpec = MISSING
    reward: RewardSpec = MISSING
    tracking: TrackingSpec = MISSING
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    ray: RaySpec = field(default_factory=RaySpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    env: EnvSpec = field(default_factory=EnvSpec)
    mode: str = "run"  # run | plan
    output_dir: Optional[str] = None  # the run directory; None: Hydra's hydra.run.dir
    resume: Optional[str] = None


def register() -> None:
    """Register schemas in Hydra's ConfigStore (group files extend ``<group>/schema``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="rlhf_schema", node=RunConfig)
    for kind, cls in ALGO_SCHEMAS.items():
        cs.store(group="algo", name=f"{kind}_schema", node=cls)
    for group, cls in [
        ("model", ModelSpec),
        ("hardware", HardwareSpec),
        ("placement", PlacementSpec),
        ("data", DataSpec),
        ("reward", RewardSpec),
        ("tracking", TrackingSpec),
    ]:
        cs.store(group=group, name="schema", node=cls)
