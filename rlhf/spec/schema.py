"""Typed schemas of every config group.

These dataclasses are registered in Hydra's ConfigStore (see ``register``), so composition already
rejects unknown keys and wrong types with the key path; ``rlhf.spec.build`` then merges a composed
config onto them again (so a saved run config rebuilds the same spec without Hydra), validates,
derives the batch plan and freezes the result.

A field exists only where code reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Optional, Union

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


# --------------------------------------------------------------------------- field docs


def doc(default: Any, help: str) -> Any:
    """A dataclass field carrying its help text in ``metadata["help"]`` (OmegaConf ignores metadata);
    ``rlhf-run --describe KEY`` prints it."""
    return field(default=default, metadata={"help": help})


def docf(factory: Callable[[], Any], help: str) -> Any:
    """``doc`` for a field whose default ``factory()`` builds (a list, a section)."""
    return field(default_factory=factory, metadata={"help": help})


# the optimizer fields every trainer has, one help text each
def _lr(default: float) -> Any:
    return doc(default, "Peak learning rate (AdamW).")


def _weight_decay() -> Any:
    return doc(0.0, "AdamW's decoupled weight decay.")


def _warmup_steps() -> Any:
    return doc(0, "Optimizer steps of linear learning-rate warm-up from 0 to lr.")


def _max_grad_norm() -> Any:
    return doc(1.0, "Clip the global gradient norm to this value before each optimizer step.")


def _eval_fraction(what: str) -> Any:
    return doc(0.1, f"Share of the training {what} held out for evaluation when data.eval_files is empty.")


def undocumented_fields() -> list[str]:
    """``Class.field`` of every schema field without a help text (a test keeps this empty)."""
    out = []
    for obj in list(globals().values()):
        if isinstance(obj, type) and is_dataclass(obj) and obj.__module__ == __name__:
            out += [f"{obj.__name__}.{f.name}" for f in fields(obj) if not f.metadata.get("help", "").strip()]
    return out


# --------------------------------------------------------------------------- algo


@dataclass
class KLSpec(Frozen):
    """The KL penalty against the frozen reference policy."""

    coef: float = doc(0.0, "Weight beta of the KL term; 0 = no reference model is loaded. Larger keeps the "
                      "policy near the reference (less reward hacking) at the cost of slower reward gains.")
    estimator: str = doc("k3", "Per-token KL estimator of log(pi/pi_ref): k1 (the log-ratio, unbiased, can "
                         "go negative), k2 (half its square, biased, low variance), k3 (exp(-x)-1+x, unbiased, "
                         "non-negative; Schulman's approximations), or one registered by algo.plugins.")
    placement: str = doc("loss", "loss: add beta*KL to the policy loss (GRPO); reward: subtract it from the "
                         "per-token rewards before the advantages (PPO as in Ouyang et al. 2022).")
    adaptive: bool = doc(False, "Adapt coef towards kl.target (Ziegler et al. 2019); only with placement=reward.")
    target: float = doc(6.0, "The adaptive controller's target for the measured KL (the kl/mean metric).")
    horizon: int = doc(10000, "The adaptive controller's horizon in samples: larger changes coef more slowly.")
    clamp: float = doc(10.0, "The log-ratio is clamped to [-clamp, clamp] before the estimator, so one "
                       "far-off token cannot blow up the loss.")


@dataclass
class CriticSpec(Frozen):
    """The value model of PPO (gae); absent for critic-free estimators."""

    lr: float = doc(1e-5, "The critic's learning rate (usually above the policy's: it learns a regression).")
    value_clip: float = doc(0.2, "Clip the new values to old +- value_clip in the value loss (PPO's value "
                            "clipping); limits how far one update moves the critic.")
    warmup_steps: int = doc(0, "Optimizer steps of linear learning-rate warm-up of the critic.")


@dataclass
class TeacherSpec(Frozen):
    """On-policy distillation's teacher (algo=opd, Agarwal et al. 2024; Thinking Machines 2025): a
    frozen causal LM whose per-token divergence from the student on the student's own samples is
    the student's negative advantage (rlhf.algos.distill). Placed like the reference model."""

    path: Optional[str] = doc(None, "The teacher: a local HF checkpoint dir, a Hub id or builtin:<name>; None = "
                              "no teacher. It must use the student's tokenizer (the same token ids).")
    revision: Optional[str] = doc(None, "teacher.path's branch, tag or commit when it is a Hub id.")
    divergence: str = doc("reverse_kl", "reverse_kl: advantage -(log pi_student - log pi_teacher) of each "
                          "sampled token (Thinking Machines / Qwen3); jsd: GKD's generalised Jensen-Shannon "
                          "divergence with teacher.beta, advantage -(1-beta)(log pi_student - log M), "
                          "M = beta pi_teacher + (1-beta) pi_student (rlhf.algos.distill).")
    beta: float = doc(0.5, "jsd: GKD's beta, strictly between 0 and 1 (towards 1 it approaches reverse KL, "
                      "scaled by 1 - beta; towards 0 forward KL, scaled by beta).")
    coef: float = doc(1.0, "Weight of the divergence in the advantage (the per-token reward is -coef times it).")
    clamp: Optional[float] = doc(None, "Bound each token's divergence term to [-clamp, clamp]; None = unbounded "
                                 "(the exact per-token objective).")
    offload: bool = doc(False, "hybrid placement on GPU: the teacher's weights wait in host memory while the "
                        "rollout engines generate and come back for its pass (less GPU memory in the "
                        "generation phase, a copy each way per step); false: they stay resident.")
    n_layers: Optional[int] = doc(None, "The teacher's decoder layers (memory planning); None = its config.json's "
                                  "when the driver can read it, else the student's (model.n_layers).")
    hidden: Optional[int] = doc(None, "The teacher's hidden size (memory planning); None as for n_layers.")
    intermediate: Optional[int] = doc(None, "The teacher's MLP size (memory planning); None as for n_layers.")
    n_heads: Optional[int] = doc(None, "The teacher's attention heads (memory planning); None as for n_layers.")
    n_kv_heads: Optional[int] = doc(None, "The teacher's key/value heads (memory planning); None as for n_layers.")
    vocab: Optional[int] = doc(None, "The teacher's vocabulary (memory planning); None as for n_layers.")
    tie_embeddings: Optional[bool] = doc(None, "The teacher's head shares its embedding; None as for n_layers.")


@dataclass
class RLAlgo(Frozen):
    """PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline."""

    name: str = doc(MISSING, "The algorithm's name (the algo group option), shown in logs and the plan.")
    kind: str = doc("rl", "Which trainer runs: rl (rollouts and policy gradients); fixed per schema.")
    estimator: str = doc(MISSING, "Advantage estimator (rlhf.algos.registry): gae (PPO, needs algo.critic), "
                         "grpo (group-normalized rewards, Shao et al. 2024), dr_grpo (no std or length "
                         "normalization, Liu et al. 2025), rloo (leave-one-out baseline, Ahmadian et al. "
                         "2024), reinforce_pp / reinforce_pp_baseline (REINFORCE++, Hu 2025), or one "
                         "registered by algo.plugins.")
    policy_loss: str = doc("clip", "Policy loss: clip (PPO's clipped surrogate, Schulman et al. 2017), cispo "
                           "(clipped importance weights, every token keeps a gradient; MiniMax-M1 2025; the "
                           "weight is clipped to [1 - clip_low, 1 + clip_high]), sapo (a soft sigmoid gate on "
                           "the ratio instead of the clip, Gao et al. 2025; algo.tau_pos / tau_neg), or one "
                           "registered by algo.plugins.")
    plugins: list[str] = docf(list, "Modules imported in the driver and every worker before the parts are "
                              "looked up; their decorators register more estimators, policy losses and KL estimators.")
    group_size: int = doc(1, "Responses sampled per prompt. Group estimators (grpo, rloo, ...) need >= 2: "
                          "the group is the baseline. More gives better baselines, fewer prompts per batch.")
    normalize_std: bool = doc(True, "grpo: divide each group's centred rewards by the group's std. Off (as "
                              "in Dr.GRPO) avoids up-weighting prompts that are almost always right or wrong.")
    gamma: float = doc(1.0, "gae: discount per token; 1.0 = no discount, usual for a reward at the end.")
    lam: float = doc(0.95, "gae: lambda of generalized advantage estimation (Schulman et al. 2016): lower "
                     "trusts the critic more (less variance, more bias).")
    whiten_advantages: bool = doc(True, "gae: scale advantages to mean 0, std 1 over the batch (off: raw GAE).")
    clip_low: float = doc(0.2, "Lower clip epsilon: the ratio is clipped below at 1 - clip_low.")
    clip_high: float = doc(0.2, "Upper clip epsilon: the ratio is clipped above at 1 + clip_high; above "
                           "clip_low ('clip-higher', DAPO, Yu et al. 2025) keeps exploration from collapsing.")
    dual_clip: Optional[float] = doc(None, "Dual-clip constant c > 1 (Ye et al. 2020): bounds the loss of "
                                     "negative-advantage tokens at c*|A|; None = off.")
    tau_pos: float = doc(1.0, "sapo: temperature of the soft gate for positive advantages; larger damps "
                         "updates sooner as the ratio leaves 1 (SAPO's default 1.0).")
    tau_neg: float = doc(1.05, "sapo: temperature of the soft gate for negative advantages (SAPO's default "
                         "1.05, above tau_pos: negative updates are the less stable ones).")
    ratio_level: str = doc("token", "token: one importance ratio per token (PPO/GRPO); sequence: one per "
                           "sequence, the geometric mean of its tokens' ratios (GSPO, Zheng et al. 2025).")
    loss_agg: str = doc("token_mean", "How token losses become one number: token_mean (over all policy tokens "
                        "of the batch), seq_mean_token_sum, seq_mean_token_mean (GRPO's original), "
                        "seq_mean_token_sum_norm (Dr.GRPO: divided by a constant length). See rlhf.algos.losses.")
    tis_cap: Optional[float] = doc(None, "Truncated importance sampling (Yao et al. 2025): weight each token's loss "
                                   "by the trainer/rollout probability ratio capped at this value, correcting "
                                   "the rollout engine's numeric mismatch (vLLM vs training kernels); None = off.")
    async_steps: int = doc(0, "Rollouts of the next k steps overlap the update (policy staleness <= k steps): "
                           "faster, slightly off-policy; 0 = synchronous.")
    entropy_coef: float = doc(0.0, "Weight of an entropy bonus in the loss; > 0 encourages exploration.")
    kl: KLSpec = docf(KLSpec, "The KL penalty against the reference policy.")
    teacher: TeacherSpec = docf(TeacherSpec, "On-policy distillation's teacher (algo=opd; estimator distill).")
    critic: Optional[CriticSpec] = doc(None, "The value model (needed by gae); None for critic-free estimators.")
    lr: float = doc(1e-6, "The policy's peak learning rate (AdamW).")
    weight_decay: float = _weight_decay()
    warmup_steps: int = _warmup_steps()
    max_grad_norm: float = _max_grad_norm()
    epochs: int = doc(1, "Passes over each rollout batch; > 1 reuses samples (more off-policy, clipped by the ratio).")
    mini_batch_size: Optional[int] = doc(None, "Samples per optimizer step (global); None = the whole batch in "
                                         "one step. Smaller means more updates per rollout batch.")
    overlong_buffer: Optional[int] = doc(None, "DAPO soft overlong penalty: over the last this-many tokens "
                                         "before rollout.max_response_tokens the penalty grows linearly; None = off.")
    overlong_buffer_fraction: Optional[float] = doc(None, "DAPO soft overlong penalty with the buffer as a "
                                                    "share of rollout.max_response_tokens (DAPO: 4096 of 20480 "
                                                    "= 0.2), rounded up, so a preset fits every length limit; "
                                                    "set this or overlong_buffer, not both; None = off.")
    overlong_penalty: float = doc(1.0, "The overlong penalty at the length limit (reaches -overlong_penalty).")
    reward_clip: Optional[float] = doc(None, "Clip scores to [-reward_clip, reward_clip] before the "
                                       "advantages; None = off.")
    reward_normalize: bool = doc(False, "Normalize the batch's scores to mean 0, std 1 before the advantages.")
    dynamic_sampling: bool = doc(False, "DAPO: drop groups whose rewards are all equal (they carry no group "
                                 "advantage) and sample more prompts, a few rounds at most, to fill the batch.")


@dataclass
class OfflineAlgo(Frozen):
    """What the trainers on a fixed data set (dpo, rm, sft) share: the optimizer and the passes over the
    data. Each subclass sets its name and kind (and may change a default or help text); its own fields
    follow these."""

    name: str = doc(MISSING, "The algorithm's name (the algo group option).")
    kind: str = doc(MISSING, "Which trainer runs: dpo | rm | sft; fixed per schema.")
    lr: float = _lr(1e-5)
    weight_decay: float = _weight_decay()
    warmup_steps: int = _warmup_steps()
    max_grad_norm: float = _max_grad_norm()
    epochs: int = doc(1, "Passes over the training pairs.")
    eval_fraction: float = _eval_fraction("pairs")
    packing: bool = doc(False, "Pack chosen/rejected sequences of a micro-batch into shared rows (less padding).")


@dataclass
class DPOAlgo(OfflineAlgo):
    """The preference trainer: direct preference optimization (Rafailov et al. 2023) and its relatives
    on chosen/rejected pairs, KTO on unpaired rows, ORPO and SimPO without a reference model
    (algo=dpo|kto|orpo|simpo pick algo.loss_type and its paper's settings)."""

    name: str = doc("dpo", "The algorithm's name (the algo group option).")
    kind: str = doc("dpo", "Which trainer runs: dpo (the preference trainer of dpo, kto, orpo, simpo); fixed "
                    "per schema.")
    lr: float = _lr(5e-7)
    beta: float = doc(0.1, "dpo/kto: inverse temperature of the implicit reward beta*log(pi/pi_ref), larger "
                      "stays closer to the reference model; simpo: the reward's scale beta*(1/|y|)log pi (2.0); "
                      "orpo: lambda, the odds-ratio term's weight beside the SFT loss (0.1).")
    loss_type: str = doc("sigmoid", "sigmoid (DPO's logistic loss), ipo (squared loss towards 1/(2 beta), "
                         "Azar et al. 2023), hinge (SLiC-HF, Zhao et al. 2023), kto (Ethayarajh et al. 2024: "
                         "unpaired desirable/undesirable completions), orpo (Hong et al. 2024: SFT + odds "
                         "ratio, no reference) or simpo (Meng et al. 2024: length-normalised margin, no "
                         "reference); algo=kto|orpo|simpo set it.")
    label_smoothing: float = doc(0.0, "Assumed share of flipped preference labels (cDPO); 0 = trust the labels.")
    reference_free: bool = doc(False, "Use no reference model: cheaper, but nothing anchors the policy to its "
                               "start. orpo and simpo need it true (they have no reference term).")
    gamma: float = doc(1.0, "simpo: the target reward margin gamma between chosen and rejected (the paper's "
                       "gamma/beta of about 0.5).")
    desirable_weight: float = doc(1.0, "kto: lambda_D, the weight of desirable examples' loss; the paper keeps "
                                  "lambda_D n_D / (lambda_U n_U) in [1, 4/3].")
    undesirable_weight: float = doc(1.0, "kto: lambda_U, the weight of undesirable examples' loss.")


@dataclass
class RMAlgo(OfflineAlgo):
    """A reward model (scalar head) trained on chosen/rejected pairs with the Bradley-Terry loss."""

    name: str = doc("rm", "The algorithm's name (the algo group option).")
    kind: str = doc("rm", "Which trainer runs: rm; fixed per schema.")
    margin: Optional[float] = doc(None, "Required score margin between chosen and rejected (Llama 2's margin "
                                  "loss); None = plain Bradley-Terry.")


@dataclass
class SFTAlgo(OfflineAlgo):
    """Supervised fine-tuning: cross-entropy on the response tokens."""

    name: str = doc("sft", "The algorithm's name (the algo group option).")
    kind: str = doc("sft", "Which trainer runs: sft; fixed per schema.")
    epochs: int = doc(1, "Passes over the training examples.")
    eval_fraction: float = _eval_fraction("examples")
    packing: bool = doc(False, "Pack several examples of a micro-batch into shared rows (less padding).")


ALGO_SCHEMAS = {"rl": RLAlgo, "dpo": DPOAlgo, "rm": RMAlgo, "sft": SFTAlgo}
AlgoSpec = Union[RLAlgo, DPOAlgo, RMAlgo, SFTAlgo]  # the algo section of a built spec


# --------------------------------------------------------------------------- model


# The linear projections of a Llama/Qwen decoder layer (attention and MLP): LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSpec(Frozen):
    """LoRA adapters on the policy (Hu et al. 2021): each target Linear W trains W + (alpha/rank)·B·A
    with W frozen; the rollout engines and the HF export get the merged weights (rlhf.models.lora)."""

    rank: int = doc(0, "r of A (r x in) and B (out x r); 0 = off, every weight trains. Larger adapts more "
                    "and costs more optimizer memory.")
    alpha: float = doc(16.0, "The update is scaled by alpha / rank.")
    dropout: float = doc(0.0, "Dropout on the adapter's input while training.")
    target_modules: list[str] = docf(lambda: list(LORA_TARGETS), "Names of the Linear modules that get "
                                     "adapters (default: the attention and MLP projections).")


@dataclass
class ModelSpec(Frozen):
    """A model: where to load it and the architecture numbers that memory planning needs."""

    name: str = doc(MISSING, "The model's name (the model group option), shown in logs and the plan.")
    path: str = doc(MISSING, "Local HF checkpoint dir, Hugging Face Hub id (org/name), or builtin:<name>.")
    revision: Optional[str] = doc(None, "A Hub id's branch, tag or commit; None = main.")
    n_layers: int = doc(MISSING, "Decoder layers (memory planning).")
    hidden: int = doc(MISSING, "Hidden size (memory planning).")
    intermediate: int = doc(MISSING, "MLP intermediate size (memory planning).")
    n_heads: int = doc(MISSING, "Attention heads (memory planning).")
    n_kv_heads: int = doc(MISSING, "Key/value heads (grouped-query attention; sizes the KV cache).")
    vocab: int = doc(MISSING, "Vocabulary size (memory planning: embeddings and logits).")
    tie_embeddings: bool = doc(False, "The output head shares the input embedding's weights.")
    dtype: str = doc("bfloat16", "Weights' dtype: bfloat16 | float16 | float32.")
    gradient_checkpointing: bool = doc(False, "Recompute activations in the backward pass: much less "
                                       "activation memory for about a third more compute.")
    liger_kernels: Any = doc("auto", "GPU: Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the "
                             "training-side models (fewer elementwise passes, less activation memory). "
                             "auto: on for CUDA runs when the liger-kernel package is installed and "
                             "covers the model's model_type, and the layers are not compiled "
                             "(model.compile_layers).")
    compile_layers: Any = doc("auto", "torch.compile each decoder layer of the training-side models (regional "
                              "compilation, dynamic shapes: one graph serves every layer; inductor fuses the norms, "
                              "SwiGLU, RoPE and residual adds): auto | true | false. auto: on for RL on CUDA where "
                              "Liger's kernels are off (not installed, or not covering the model), without LoRA, "
                              "activation checkpointing, ZeRO-3 or offloaded states: the GRPO loop's update 1.31× faster than eager "
                              "layers at 0.5B on an H200; off beside Liger's kernels (1.12× them; BENCHMARKS §12). "
                              "true: the first passes pay the compilation (~14 s at 0.5B), Liger's kernels go off "
                              "(model.liger_kernels auto; true with both is refused), a compile failure warns once "
                              "and runs the layers eagerly; on CPU the layers are traced only (aot_eager backend: "
                              "no speed-up, for tests).")
    lora: LoraSpec = docf(LoraSpec, "LoRA adapters: rank > 0 trains adapters, not the policy's weights.")


# --------------------------------------------------------------------------- hardware


@dataclass
class HardwareSpec(Frozen):
    """The machines: what the plan places roles on and checks memory against."""

    name: str = doc(MISSING, "The hardware's name (the hardware group option).")
    accelerator: str = doc("cuda", "cuda | cpu (cpu: DeepSpeed's CPU accelerator with gloo, HF generate).")
    nodes: int = doc(1, "Machines in the Ray cluster.")
    devices_per_node: int = doc(1, "GPUs per node, or CPU worker slots when accelerator=cpu.")
    device_memory_gb: float = doc(0.0, "Memory of one GPU: the device's total as CUDA reports it, in GB (1e9 "
                                  "bytes; an H200's 143,771 MiB is 150.7), which the plan checks each role "
                                  "against; vLLM's share is rollout.gpu_memory_utilization of it.")
    peak_bf16_tflops: float = doc(0.0, "Peak dense bf16 TFLOP/s of one device; compared when the plan "
                                  "suggests other hardware of the same kind.")
    host_memory_gb: float = doc(0.0, "Host memory of one node (GB): the plan checks what the run keeps there "
                                "(offloaded optimizer and training states, model loading, processes); "
                                "0 = not checked.")


# --------------------------------------------------------------------------- placement


@dataclass
class RolloutPlacement(Frozen):
    """The generation engines."""

    engines: int = doc(1, "Rollout engines in all (data-parallel copies of the policy that generate; 0 = as "
                       "many as fit: rollout devices / tensor_parallel × engines_per_device).")
    tensor_parallel: int = doc(1, "GPUs per engine (tensor parallelism): for models one GPU cannot hold.")
    engines_per_device: Any = doc("auto", "Rollout engines sharing one device, each its own process with its "
                                  "copy of the weights, the prompts split between them: auto | 1 | 2 | 4. "
                                  "Small models decode host-bound (the GPU waits on the Python scheduler), "
                                  "so two engines keep it busier: in the GRPO loop on an H200 generation "
                                  "1.41x and the step 1.24x at 0.5B, 1.21x and 1.10x at 1.5B, same "
                                  "trainer-vLLM mismatch (BENCHMARKS §10). vLLM's gpu_memory_utilization is split between "
                                  "them (same total), each engine adds its weights and CUDA context. "
                                  "auto: 2 for models of <= 2B parameters at tensor_parallel 1 on CUDA "
                                  "when the memory figures fit with the extra engine, else 1 (always 1 "
                                  "on CPU). Needs tensor_parallel 1.")


@dataclass
class PlacementSpec(Frozen):
    """hybrid: every role spans the same devices; disaggregated: each role gets its own."""

    mode: str = doc(MISSING, "hybrid (training and generation share every device, switching each step) | "
                    "disaggregated (each role on its own devices, no switching, fewer devices each) | a "
                    "placement registered by placement.plugins (rlhf.placement.registry).")
    plugins: list[str] = docf(list, "Modules imported in the driver before the placement is looked up; their "
                              "@register_placement classes add placements (which roles share devices).")
    actor: int = doc(0, "disaggregated: devices of the policy's trainer (0 = not placed).")
    critic: int = doc(0, "disaggregated: devices of the critic (0 = not used).")
    reference: int = doc(0, "disaggregated: devices of the reference model (0 = not used).")
    reward: int = doc(0, "disaggregated: devices of the reward model (0 = not used).")
    teacher: int = doc(0, "disaggregated: devices of the distillation teacher (0 = automatic when there is one).")
    rollout: RolloutPlacement = docf(RolloutPlacement, "The generation engines.")
    sleep_rollout: Any = doc("auto", "hybrid: vLLM releases its weights and KV cache while training runs: "
                             "auto | true | false. auto sleeps unless algo.async_steps > 0, whose engines "
                             "generate during the update (vLLM then stays awake beside it), or the plan's "
                             "training phase holds the engines awake beside everything else (no sleep and "
                             "wake-up each step).")
    offload_train_state: Any = doc("auto", "hybrid: DeepSpeed's states leave the GPU while vLLM generates: "
                                   "auto | true | false. auto keeps them when the generation phase fits "
                                   "with them resident, since moving them costs time every step.")


# --------------------------------------------------------------------------- rollout / train


@dataclass
class RolloutSpec(Frozen):
    """Sampling of the responses."""

    engine: str = doc("auto", "auto | hf | vllm | an engine registered by rollout.plugins (auto: vllm on cuda, "
                      "hf on cpu).")
    plugins: list[str] = docf(list, "Modules imported in the driver and the rollout workers before the engine is "
                              "looked up; their @register_engine classes add rollout engines "
                              "(rlhf.rollout.registry).")
    max_prompt_tokens: int = doc(64, "Prompts are cut to this many tokens.")
    max_response_tokens: int = doc(16, "Generation stops after this many tokens.")
    temperature: float = doc(1.0, "Sampling temperature; 1.0 samples the policy itself (what the "
                             "policy-gradient math assumes).")
    top_p: float = doc(1.0, "Nucleus sampling mass; 1.0 = off.")
    top_k: int = doc(-1, "Sample among the k likeliest tokens; -1 = off.")
    gpu_memory_utilization: float = doc(0.5, "vLLM's share of each GPU (weights + KV cache).")
    enforce_eager: bool = doc(False, "vLLM without CUDA graphs: slower decoding, faster start, less memory.")
    seeded: Optional[bool] = doc(None, "A seed per prompt (from train.seed, the step and the prompt's place), "
                                 "so a step's samples can be drawn again. None = auto: on with HF generate; "
                                 "off with vLLM, whose sampler draws seeded requests one by one.")


@dataclass
class TrainSpec(Frozen):
    """Steps, batch sizes and memory options of training."""

    steps: int = doc(100, "Training steps (RL: rollout + update rounds; sft/rm/dpo: optimizer steps).")
    prompts_per_step: int = doc(16, "Prompts per step; the batch is prompts_per_step x algo.group_size samples.")
    micro_batch_size: int = doc(8, "Samples per forward/backward on one rank (sft: examples or packed rows; "
                                "rm/dpo: pairs).")
    max_tokens_per_micro_batch: Optional[int] = doc(None, "RL: tokens per packed forward/backward on one rank "
                                                    "(passes pack samples up to it); None = micro_batch_size x "
                                                    "(max_prompt_tokens + max_response_tokens). sft/rm/dpo do "
                                                    "not read it (leave it null).")
    compile_logprobs: Any = doc("auto", "torch.compile the LM head's per-chunk log-prob/entropy passes "
                                "(forward and written-out backward fused into a few kernels): auto | true | "
                                "false. auto: on CUDA (a compile failure falls back to eager, with a warning).")
    expandable_segments: bool = doc(False, "GPU: the training processes' PyTorch allocator maps memory in "
                                    "growable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), against "
                                    "the fragmentation that moves a step's reserved peak; the weight-sync buffers "
                                    "vLLM opens over CUDA IPC stay in ordinary segments.")
    zero_stage: Any = doc("auto", "DeepSpeed ZeRO stage 0-3, or auto: ZeRO-3 only when several ranks share the "
                          "model and ZeRO-2 does not fit; 0 on CPU.")
    seed: int = doc(0, "Seed of data order, sampling and initialisation.")
    offload_optimizer: Any = doc("auto", "Adam's state in host memory (DeepSpeed's CPU Adam): auto | true | "
                                 "false. auto: only when training does not fit otherwise (slower steps).")


# --------------------------------------------------------------------------- data / reward / tracking


@dataclass
class DataSpec(Frozen):
    """The data sets and how their rows become prompts and examples."""

    name: str = doc(MISSING, "The data set's name (the data group option).")
    train_files: list[str] = docf(list, "Paths, builtin:<task>/<split>, or Hub data sets "
                                  "hub:<org>/<name>[@<revision>][:<config>]:<split>.")
    eval_files: list[str] = docf(list, "Evaluation files, in the same forms as train_files.")
    weights: Optional[list[float]] = doc(None, "Mixing weights, one per train file; None = concatenate.")
    prompt_key: str = doc("prompt", "The column holding the prompt.")
    response_key: str = doc("response", "sft: the column holding the target response; kto: the completion of "
                            "an unpaired row.")
    label_key: str = doc("label", "kto: the column holding an unpaired row's label, true (desirable) or false "
                         "(undesirable); rows with chosen/rejected give one of each instead.")
    chosen_key: str = doc("chosen", "rm/dpo: the column holding the preferred response.")
    rejected_key: str = doc("rejected", "rm/dpo: the column holding the dispreferred response.")
    messages_key: str = doc("messages", "The column holding a chat (a list of role/content messages).")
    tools_key: str = doc("tools", "The column holding a row's tools: sft, their JSON schemas (the chat template "
                         "renders them); RL with agent.enabled, the names of the agent.tools its prompt offers "
                         "(absent: all of them).")
    columns: list[str] = docf(list, "Renames in every file's rows, old:new, e.g. [question:prompt].")
    chat_template: bool = doc(False, "Render prompts with the tokenizer's chat template.")
    max_length: Optional[int] = doc(None, "sft/rm/dpo: tokens per sequence (prompt + response; a pair's "
                                    "chosen and rejected each); the plan sizes their passes by it. None = "
                                    "rollout.max_prompt_tokens + rollout.max_response_tokens.")
    truncation: str = doc("right", "sft/rm/dpo, examples over max_length: right | left (cut the prompt's "
                          "start) | drop.")
    shuffle: bool = doc(True, "Shuffle the training rows (seeded by train.seed).")


@dataclass
class RewardFnSpec(Frozen):
    """A reward function scored on each response."""

    fn: str = doc(MISSING, "module:function or path/to/file.py:function.")
    weight: float = doc(1.0, "The function's weight in the summed reward.")
    name: Optional[str] = doc(None, "Its name in metrics (reward/<name>/mean); None = the function's name.")


@dataclass
class RemoteRewardSpec(Frozen):
    """An HTTP reward service (``rlhf-reward-server`` or anything speaking ``rlhf.rewards.remote``)."""

    urls: list[str] = docf(list, "http://host:port of each server; requests spread round-robin.")
    weight: float = doc(1.0, "The service's weight in the summed reward.")
    name: str = doc("remote", "The part's name in metrics (reward/<name>/mean).")
    batch_size: int = doc(64, "Samples per request.")
    concurrency: int = doc(4, "Requests in flight.")
    timeout_s: float = doc(60.0, "Seconds per request.")
    retries: int = doc(3, "Extra attempts per request (next URL, exponential backoff).")


@dataclass
class RewardSpec(Frozen):
    """What scores a response: functions, a remote service and/or a reward model, summed by weight."""

    name: str = doc(MISSING, "The reward's name (the reward group option).")
    functions: list[RewardFnSpec] = docf(list, "Reward functions (fn, weight, name), scored on every response.")
    remote: Optional[RemoteRewardSpec] = doc(None, "A reward service, scored beside the functions; None = none.")
    model_path: Optional[str] = doc(None, "A reward model checkpoint (scalar head): local dir or Hub id.")
    model_revision: Optional[str] = doc(None, "model_path's branch, tag or commit when it is a Hub id.")
    model_weight: float = doc(1.0, "The reward model's weight in the summed reward.")
    timeout_s: float = doc(60.0, "Seconds a reward function may take before it counts as hung.")
    isolate: Any = doc("auto", "auto | true | false. true: run the reward functions in a process of their own, "
                       "so that a crash, os._exit, sys.exit or running out of memory in one is one line naming it "
                       "and the run stops cleanly (steps done checkpointed); false: in the driver itself (a "
                       "debugger's breakpoint works there, a crash takes the driver with it); auto: yours in the "
                       "process, the project's own (rlhf.* modules, e.g. rlhf.rewards.math:arith_reward) in the "
                       "driver.")
    memory_gb: Optional[float] = doc(None, "The reward process's memory cap in GB (RLIMIT_DATA; with "
                                     "reward.isolate): an allocation past it raises MemoryError inside the function. "
                                     "None = half this machine's memory; 0 = no cap.")


TRACKERS = ("mlflow", "tensorboard", "wandb")


def tracking_backends(value: Any) -> tuple[str, ...]:
    """``tracking.backend`` as the tuple of trackers it names: one name, ``none`` or a list
    (``[mlflow,tensorboard]``); ``none`` inside a list counts as nothing."""
    names = [value] if isinstance(value, str) or value is None else list(value)
    return tuple(dict.fromkeys(str(n) for n in names if n not in (None, "none", "")))


@dataclass
class WandbSpec(Frozen):
    """Weights & Biases, when ``wandb`` is one of tracking.backend."""

    project: Optional[str] = doc(None, "The W&B project; None = tracking.experiment.")
    entity: Optional[str] = doc(None, "The W&B entity (user or team); None = the account's default.")
    mode: Optional[str] = doc(None, "online | offline; None = the WANDB_MODE environment variable, else online. "
                              "offline writes <run dir>/wandb/offline-run-*, sent later with `wandb sync DIR`.")
    tags: list[str] = docf(list, "Tags of the W&B run (the algo name is always one).")


@dataclass
class TrackingSpec(Frozen):
    """Metrics: where they are stored and shown."""

    backend: Any = doc("mlflow", "The trackers: mlflow | tensorboard | wandb | none, or several as a list "
                       "(tracking.backend=[mlflow,tensorboard,wandb]). Each gets the same metric names and steps; "
                       "tensorboard writes <run dir>/tensorboard (tensorboard --logdir a sweep dir groups its jobs); "
                       "one that fails (disk, credentials) is dropped with one line and training goes on.")
    uri: Optional[str] = doc(None, "The MLflow tracking URI; None = the project's sqlite store, "
                             "outputs/mlflow.db of the directory rlhf-run was started in ($RLHF_TRACKING_DIR "
                             "names another folder), shared by every run and sweep started there.")
    experiment: str = doc("rlhf", "The experiment's name in the tracking store (MLflow experiment, W&B project).")
    wandb: WandbSpec = docf(WandbSpec, "Weights & Biases settings.")
    console: str = doc("rich", "What the console shows: rich (a live progress bar on a terminal, else plain) | "
                       "plain (a line per step) | verbose (plain, and every worker's own output: vLLM, DeepSpeed, "
                       "Ray, NCCL, torch warnings) | none. Except with verbose, each worker's output goes to "
                       "<run dir>/logs/<role>_<rank>.log instead.")
    log_every: int = doc(1, "Steps between metric logs.")
    report: bool = doc(True, "At the end of the run, draw <run dir>/report/report.png and report.html (the "
                       "curves; also MLflow artifacts under report/). false skips them (matplotlib's import and "
                       "drawing, ~1.5 s of CPU); rlhf-report <run dir> draws them later from metrics.jsonl.")
    objective: str = doc("reward/mean", "What a sweep (-m) returns to Hydra's sweeper (e.g. Optuna's "
                         "objective): this metric's mean over the last fifth of the steps that logged it.")


@dataclass
class CheckpointSpec(Frozen):
    """Saving and rotating checkpoints."""

    every: int = doc(0, "Steps between checkpoints; 0 = only at the end (and at a stop by Ctrl-C / SIGTERM).")
    keep_last: int = doc(2, "Newest checkpoints kept; older ones are deleted.")
    save_hf: bool = doc(True, "An HF-format export of each trained role inside every checkpoint.")
    best_metric: Optional[str] = doc(None, "e.g. eval/greedy/reward_mean: its best (highest) checkpoint "
                                     "survives rotation; None = off.")
    push_to_hub: Optional[str] = doc(None, "A Hub repo id (org/name): at the end of the run, final/hf (and a LoRA "
                                     "policy's adapter, under adapter/) is uploaded there with a model card; "
                                     "the token is HF_TOKEN or `hf auth login`. A failed upload leaves the local "
                                     "export as it is and says so in one line. None = no upload.")
    hub_private: bool = doc(True, "push_to_hub creates the repo private (an existing repo keeps its visibility).")


@dataclass
class EvalSpec(Frozen):
    """RL evaluation on data.eval_files (rlhf.loops.rl_eval): greedy and sampled, per data source."""

    every: int = doc(0, "Steps between evaluations (and after the last step); 0 = off.")
    n_samples: int = doc(4, "Sampled responses per prompt: pass@n_samples.")
    pass_threshold: float = doc(1.0, "A response passes when its reward is >= this.")
    max_prompts: Optional[int] = doc(None, "The first N eval prompts; None = all.")
    before_training: bool = doc(False, "Also evaluate the starting policy before the first step (logged with "
                                "step 1 as eval_before/...).")


@dataclass
class EnvSpec(Frozen):
    """A multi-turn environment (rlhf.envs): the model and the environment take turns."""

    fn: Optional[str] = doc(None, "module:Class with reset(row) and step(response) -> feedback, reward, done; "
                            "None = single turn.")
    max_turns: int = doc(1, "Model turns per episode (at most).")


@dataclass
class AgentLimitsSpec(Frozen):
    """What one agent trajectory may use (rlhf.agent.loop.TrajectoryLimits)."""

    max_turns: int = doc(4, "Assistant turns per trajectory (at most).")
    max_tool_calls: int = doc(8, "Tool calls per trajectory; calls past it are answered with an error, not run.")
    max_turn_tokens: Optional[int] = doc(None, "Tokens sampled per assistant turn; None = rollout.max_response_tokens. "
                                         "The whole trajectory after the prompt (turns and tool answers) is held "
                                         "to rollout.max_response_tokens.")
    max_wall_s: float = doc(300.0, "Seconds per trajectory, tool calls included.")


@dataclass
class SandboxSpec(Frozen):
    """The sandbox that runs model-written code (builtin:python, the code reward): rlhf.agent.sandbox."""

    isolation: str = doc("auto", "auto | bwrap | unshare | none (auto: the strongest that works here; "
                         "docs/agent.md says what each isolates).")
    workers: Optional[int] = doc(None, "Sandboxes running at once; None = the CPU count, at most 8.")
    cpu_s: int = doc(5, "CPU seconds per call.")
    wall_s: float = doc(10.0, "Wall-clock seconds per call.")
    memory_mb: int = doc(1024, "Address-space cap per call, MB.")
    output_bytes: int = doc(65536, "Output kept per call (stdout and stderr); more kills the call.")


@dataclass
class AgentSpec(Frozen):
    """Agentic RL rollouts (rlhf.agent): multi-turn chats with tool calls, each trajectory on its own."""

    enabled: bool = doc(False, "Roll out chats through the agent loop: the prompt (data.prompt_key: a string or "
                        "a list of messages) rendered with the chat template, tool calls run, trajectories "
                        "advancing independently; the reward scores the final answer.")
    tools: list[Any] = docf(list, "Tools: builtin:python, builtin:lookup, module:function, or {fn, name, "
                            "schema, description, timeout_s}.")
    parser: str = doc("hermes", "The tool-call format of the model's chat template (rlhf.agent.parsers).")
    plugins: list[str] = docf(list, "Modules imported before the parser is looked up (their "
                              "@register_parser classes add formats).")
    limits: AgentLimitsSpec = docf(AgentLimitsSpec, "Limits per trajectory.")
    sandbox: SandboxSpec = docf(SandboxSpec, "The sandbox of builtin:python.")


@dataclass
class RaySpec(Frozen):
    """The Ray cluster."""

    address: Optional[str] = doc(None, "Join an existing cluster (auto or host:port); None starts a local one.")
    num_cpus: Optional[int] = doc(None, "CPUs of the local cluster; None = Ray's own count.")
    reuse_workers: bool = doc(True, "Keep a finished CPU run's worker processes for the next run of "
                              "this driver on a Ray it joined (a sweep's jobs, in-process runs): "
                              "no new process and imports per run; false: a new process every run.")


# --------------------------------------------------------------------------- root


@dataclass
class RunConfig:
    """The root schema; ``algo`` is typed by its group file (RLAlgo, DPOAlgo, ...)."""

    algo: Any = doc(MISSING, "The training algorithm (group algo): RL (ppo, grpo, ...), dpo, rm or sft.")
    model: ModelSpec = doc(MISSING, "The policy model (group model).")
    hardware: HardwareSpec = doc(MISSING, "The machines (group hardware).")
    placement: PlacementSpec = doc(MISSING, "How roles share the devices (group placement).")
    data: DataSpec = doc(MISSING, "The data sets (group data).")
    reward: RewardSpec = doc(MISSING, "What scores responses (group reward).")
    tracking: TrackingSpec = doc(MISSING, "Metrics tracking (group tracking).")
    rollout: RolloutSpec = docf(RolloutSpec, "Sampling of the responses.")
    train: TrainSpec = docf(TrainSpec, "Steps, batch sizes and memory options.")
    checkpoint: CheckpointSpec = docf(CheckpointSpec, "Checkpoints.")
    ray: RaySpec = docf(RaySpec, "The Ray cluster.")
    eval: EvalSpec = docf(EvalSpec, "RL evaluation.")
    env: EnvSpec = docf(EnvSpec, "A multi-turn environment.")
    agent: AgentSpec = docf(AgentSpec, "Agentic rollouts: chats with tool calls.")
    mode: str = doc("run", "run | plan (plan: print the plan and exit; what --plan sets).")
    output_dir: Optional[str] = doc(None, "The run directory; None: Hydra's hydra.run.dir.")
    resume: Optional[str] = doc(None, "A run dir to continue from its newest checkpoint.")


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
