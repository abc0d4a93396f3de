"""Every check on a typed config, collected so the user sees all problems at once.

Each message names the key, the value, and a fix.
"""

from __future__ import annotations

from typing import Any, Optional

from rlhf.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    EstimatorInfo,
    Registry,
    plugin_problem,
)
from rlhf.agent.config import problems as agent_problems
from rlhf.placement.layout import divisors, plan_layout
from rlhf.placement.layout import problems as placement_problems
from rlhf.placement import registry as placements
from rlhf.rollout import registry as engines
from rlhf.spec.schema import RLAlgo
from rlhf.spec.tokens import sequence_tokens

KL_PLACEMENTS = ("loss", "reward")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
DTYPES = ("bfloat16", "float16", "float32")
LORA_KINDS = ("rl", "sft", "dpo")  # algo kinds whose trained model may carry LoRA adapters


def _choice(problems: list[str], key: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        problems.append(f"{key}={value!r} is not valid. Choose one of: {', '.join(options)}.")


def _part(problems: list[str], registry: Registry, name: str) -> None:
    if name not in registry.names():
        problems.append(registry.unknown(name))


def estimator_info(algo: RLAlgo) -> Optional[EstimatorInfo]:
    """The metadata of ``algo.estimator`` (after importing ``algo.plugins``), None if it is not
    registered or a plugin does not import (validation says so)."""
    for module in algo.plugins:
        plugin_problem(module)
    return ADVANTAGE_ESTIMATORS.info(algo.estimator) if algo.estimator in ADVANTAGE_ESTIMATORS.names() else None


def _rollout_beside_training(s: dict[str, Any], roles: tuple[str, ...]) -> bool:
    """The placement puts the rollout engines on a trained role's devices (False for an unknown
    placement: its own message says so)."""
    pl = s["placement"]
    try:
        pools = placements.get(pl.mode, pl.plugins).pools(roles)
    except Exception:  # noqa: BLE001 - an unknown placement or a plugin that does not import
        return False
    return any("rollout" in pool and ("actor" in pool or "critic" in pool) for pool in pools)


def _rollout_engine(s: dict[str, Any]) -> list[str]:
    """rollout.engine: registered (after importing rollout.plugins), runs on this hardware, and its
    kind's own rules."""
    rollout, hw = s["rollout"], s["hardware"]
    p = [msg for msg in map(engines.plugin_problem, rollout.plugins) if msg is not None]
    if p:
        return p
    known = engines.names(rollout.plugins)
    if rollout.engine != "auto" and rollout.engine not in known:
        return [f"rollout.engine={rollout.engine!r} is not valid. Choose one of: auto, {', '.join(known)} "
                "(or register another in a module named in rollout.plugins)."]
    kind = engines.get(engines.resolve(rollout.engine, hw.accelerator, rollout.plugins))
    if hw.accelerator not in kind.accelerators:
        others = [n for n in known if hw.accelerator in engines.get(n).accelerators]
        needs = "GPUs" if kind.accelerators == ("cuda",) else " or ".join(kind.accelerators)
        p.append(f"rollout.engine={kind.name} needs {needs} but hardware={hw.name}. Use "
                 f"rollout.engine={' or '.join(others) or 'auto'} (or auto), or a GPU hardware.")
    if rollout.seeded is False and kind.needs_seeds:
        p.append(f"rollout.seeded=false: the {kind.name} engine draws every sample from its own seeded generator, "
                 "so it needs the seeds. Use rollout.seeded=true (or leave it unset).")
    return p + kind.problems(s)


def validate(s: dict[str, Any], roles: tuple[str, ...], shape_from: Optional[str] = None) -> list[str]:
    """Every problem of the typed sections, one message each. ``shape_from``: where the model's
    architecture numbers came from when not from its model group (``rlhf.spec.shape.shape_source``)."""
    p: list[str] = []
    algo, hw, pl, train, rollout = s["algo"], s["hardware"], s["placement"], s["train"], s["rollout"]

    # ---- algo
    if algo.kind == "rl":
        # the plugins first: their decorators register the names checked next
        p.extend(msg for msg in map(plugin_problem, algo.plugins) if msg is not None)
        _part(p, ADVANTAGE_ESTIMATORS, algo.estimator)
        _part(p, POLICY_LOSSES, algo.policy_loss)
        _choice(p, "algo.loss_agg", algo.loss_agg, LOSS_AGGREGATIONS)
        _choice(p, "algo.ratio_level", algo.ratio_level, ("token", "sequence"))
        _part(p, KL_ESTIMATORS, algo.kl.estimator)
        _choice(p, "algo.kl.placement", algo.kl.placement, KL_PLACEMENTS)
        est = estimator_info(algo)
        if algo.group_size < 1:
            p.append(f"algo.group_size={algo.group_size} must be at least 1.")
        elif est is not None and est.grouped and algo.group_size < 2:
            p.append(
                f"algo.group_size={algo.group_size}: {algo.estimator} compares samples of the same prompt, "
                "so it needs at least 2. Use algo.group_size=4 or more."
            )
        if est is not None and est.needs_critic and algo.critic is None:
            p.append(f"algo.estimator={algo.estimator} needs a critic: set algo.critic.lr (and value_clip), "
                     "or use algo=ppo.")
        if est is not None and not est.needs_critic and algo.critic is not None:
            p.append(
                f"algo.critic is set but algo.estimator={algo.estimator} uses no critic (gae does). "
                "Remove the critic settings (algo.critic=null) or use algo=ppo."
            )
        if not algo.whiten_advantages and est is not None and not est.whiten:
            p.append(f"algo.whiten_advantages=false only applies to estimators that whiten (gae, PPO's); "
                     f"{algo.estimator} sets its own advantage scale. Drop the override.")
        if algo.clip_low <= 0 or algo.clip_high <= 0:
            p.append(f"algo.clip_low={algo.clip_low}, algo.clip_high={algo.clip_high}: clip ranges must be > 0.")
        if algo.dual_clip is not None and algo.dual_clip <= 1:
            p.append(f"algo.dual_clip={algo.dual_clip} must be > 1 (3.0 is usual), or null to turn it off.")
        if algo.async_steps < 0:
            p.append(f"algo.async_steps={algo.async_steps} must be >= 0 (0 = synchronous).")
        if algo.async_steps > 0:
            if algo.tis_cap is None:
                p.append(f"algo.async_steps={algo.async_steps} samples with a stale policy: set algo.tis_cap "
                         "(2.0 is usual) for the importance-sampling correction.")
            if algo.dynamic_sampling:
                p.append("algo.async_steps > 0 with algo.dynamic_sampling=true is not supported: turn one off.")
            if s["hardware"].accelerator == "cuda" and _rollout_beside_training(s, roles):
                p.append("algo.async_steps > 0 needs rollout engines beside the trainers: use placement=disaggregated "
                         "(hybrid GPUs sleep vLLM while training).")
            if s.get("env") is not None and s["env"].fn is not None:
                p.append("algo.async_steps > 0 with env.fn is not supported: set algo.async_steps=0.")
        if algo.tis_cap is not None and algo.tis_cap <= 0:
            p.append(f"algo.tis_cap={algo.tis_cap} must be > 0 (2.0 is usual), or null to turn it off.")
        if algo.kl.coef < 0:
            p.append(f"algo.kl.coef={algo.kl.coef} must be >= 0.")
        if algo.kl.adaptive and algo.kl.placement != "reward":
            p.append("algo.kl.adaptive=true adapts a KL penalty in the reward: set algo.kl.placement=reward.")
        if not 0 <= algo.lam <= 1 or not 0 <= algo.gamma <= 1:
            p.append(f"algo.gamma={algo.gamma}, algo.lam={algo.lam}: both must lie in [0, 1].")
        if algo.overlong_buffer is not None and not 0 < algo.overlong_buffer <= rollout.max_response_tokens:
            p.append(
                f"algo.overlong_buffer={algo.overlong_buffer} must be in (0, rollout.max_response_tokens="
                f"{rollout.max_response_tokens}]."
            )
    elif algo.kind == "dpo":
        _choice(p, "algo.loss_type", algo.loss_type, DPO_LOSSES)
        if algo.beta <= 0:
            p.append(f"algo.beta={algo.beta} must be > 0 (0.1 is usual).")
        if not 0 <= algo.label_smoothing < 0.5:
            p.append(f"algo.label_smoothing={algo.label_smoothing} must be in [0, 0.5).")
    for key in ("lr", "epochs"):
        if getattr(algo, key) <= 0:
            p.append(f"algo.{key}={getattr(algo, key)} must be > 0.")
    if hasattr(algo, "eval_fraction") and not 0 <= algo.eval_fraction < 1:
        p.append(f"algo.eval_fraction={algo.eval_fraction} must be in [0, 1).")

    # ---- model / hardware
    _choice(p, "model.dtype", s["model"].dtype, DTYPES)
    _choice(p, "hardware.accelerator", hw.accelerator, ("cuda", "cpu"))
    if hw.nodes < 1 or hw.devices_per_node < 1:
        p.append(f"hardware.nodes={hw.nodes}, hardware.devices_per_node={hw.devices_per_node}: both must be >= 1.")
        return p
    _lora_problems(p, s)
    if _auto_bool(p, "model.liger_kernels", s["model"].liger_kernels, "on when the package is installed and covers the model") \
            and s["model"].liger_kernels is True and hw.accelerator != "cuda":
        p.append("model.liger_kernels=true needs a CUDA GPU (Liger's kernels are Triton), but "
                 f"hardware={hw.name} has none. Use model.liger_kernels=false.")
    train = s["train"]
    for key, value, fix in (("train.compile_logprobs", train.compile_logprobs, "auto (on for CUDA runs) or false"),
                            ("train.expandable_segments", train.expandable_segments, "false")):
        if _is(value, (True,)) and hw.accelerator != "cuda":  # settings of CUDA's compiled kernels / allocator
            p.append(f"{key}=true needs a CUDA GPU, but hardware={hw.name} has none. Use {key}={fix}.")
    if hw.accelerator == "cpu" and s["model"].dtype == "float16":
        p.append("model.dtype=float16 is not supported on CPU. Use model.dtype=float32 or bfloat16.")
    p.extend(_rollout_engine(s))
    p.extend(agent_problems(s))

    # ---- placement
    n_before_placement = len(p)
    if hw.accelerator == "cuda" and hw.device_memory_gb <= 0:
        p.append(f"hardware.device_memory_gb={hw.device_memory_gb} must be > 0 for GPUs (80 for an H100).")
    if hw.host_memory_gb < 0:
        p.append(f"hardware.host_memory_gb={hw.host_memory_gb} must be >= 0 (GB of memory per node; 0 = not checked).")
    p.extend(placement_problems(s, roles, shape_from))

    # ---- train / batch math
    placement_ok = len(p) == n_before_placement
    if train.steps < 1:
        p.append(f"train.steps={train.steps} must be >= 1.")
    if train.prompts_per_step < 1 or train.micro_batch_size < 1:
        p.append(
            f"train.prompts_per_step={train.prompts_per_step}, train.micro_batch_size={train.micro_batch_size}: "
            "both must be >= 1."
        )
    elif placement_ok:
        p.extend(_batch_problems(s, roles))
    _train_memory_problems(p, s)
    if rollout.max_response_tokens < 1 or rollout.max_prompt_tokens < 1:
        p.append("rollout.max_prompt_tokens and rollout.max_response_tokens must be >= 1.")
    if rollout.temperature <= 0 and "rollout" in roles:
        p.append(f"rollout.temperature={rollout.temperature} must be > 0 for RL (sampling is needed).")
    if not 0 < rollout.gpu_memory_utilization < 1:
        p.append(f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1).")

    # ---- data / reward / tracking / checkpoint
    data = s["data"]
    if not data.train_files:
        p.append("data.train_files is empty. Give at least one file, e.g. data.train_files=[path/to/train.jsonl].")
    if data.weights is not None and len(data.weights) != len(data.train_files):
        p.append(
            f"data.weights has {len(data.weights)} entries but data.train_files has {len(data.train_files)}: "
            "give one weight per file."
        )
    if data.max_length is not None and data.max_length < 2:
        p.append(f"data.max_length={data.max_length} leaves no room for a prompt and a response token. "
                 "Use 2 or more, or null (= rollout.max_prompt_tokens + rollout.max_response_tokens).")
    for i, c in enumerate(data.columns):
        old, _, new = c.partition(":")
        if not old or not new or ":" in new:
            p.append(f"data.columns[{i}]={c!r} must be old:new (a column to rename and its new name), "
                     "e.g. data.columns=[question:prompt].")
    rw = s["reward"]
    has_env = s.get("env") is not None and s["env"].fn is not None
    if algo.kind == "rl" and not rw.functions and not rw.model_path and rw.remote is None and not has_env:
        p.append("this RL run has no reward: set reward.functions (module:function), reward.model_path "
                 "or reward.remote.urls.")
    if rw.remote is not None:
        rr = rw.remote
        if not rr.urls:
            p.append("reward.remote.urls is empty: give at least one reward server, e.g. "
                     "reward.remote.urls=[http://127.0.0.1:8000] (start one with rlhf-reward-server).")
        for i, u in enumerate(rr.urls):
            if not (u.startswith("http://") or u.startswith("https://")):
                p.append(f"reward.remote.urls[{i}]={u!r} must start with http:// or https://.")
        for key in ("batch_size", "concurrency"):
            if getattr(rr, key) < 1:
                p.append(f"reward.remote.{key}={getattr(rr, key)} must be >= 1.")
        if rr.retries < 0:
            p.append(f"reward.remote.retries={rr.retries} must be >= 0.")
        if rr.timeout_s <= 0:
            p.append(f"reward.remote.timeout_s={rr.timeout_s} must be > 0.")
        names = {f.name or f.fn.rpartition(":")[2] for f in rw.functions}
        if rr.name in names:
            p.append(f"reward.remote.name={rr.name!r} is also a reward function's name: choose another.")
    for i, f in enumerate(rw.functions):
        if ":" not in f.fn:
            p.append(
                f"reward.functions[{i}].fn={f.fn!r} must name a function as module:function or "
                "path/to/file.py:function."
            )
    if rw.timeout_s <= 0:
        p.append(f"reward.timeout_s={rw.timeout_s} must be > 0.")
    _choice(p, "tracking.backend", s["tracking"].backend, ("mlflow", "none"))
    _choice(p, "tracking.console", s["tracking"].console, ("rich", "plain", "none"))
    if s["checkpoint"].keep_last < 1:
        p.append(f"checkpoint.keep_last={s['checkpoint'].keep_last} must be >= 1.")
    if s["checkpoint"].every < 0:
        p.append(f"checkpoint.every={s['checkpoint'].every} must be >= 0 (0 = only at the end).")
    ev = s.get("eval")
    if ev is not None:
        if ev.every < 0:
            p.append(f"eval.every={ev.every} must be >= 0 (0 = no evaluation).")
        if ev.n_samples < 1:
            p.append(f"eval.n_samples={ev.n_samples} must be >= 1.")
        if ev.max_prompts is not None and ev.max_prompts < 1:
            p.append(f"eval.max_prompts={ev.max_prompts} must be >= 1, or null for every eval prompt.")
        if ev.every > 0 and algo.kind == "rl" and not s["data"].eval_files:
            p.append(f"eval.every={ev.every} but data.eval_files is empty: give held-out prompts, "
                     "e.g. data.eval_files=[builtin:keymap/eval], or set eval.every=0.")
    en = s.get("env")
    if en is not None:
        if en.fn is not None and ":" not in en.fn:
            p.append(f"env.fn={en.fn!r} must name a class as module:Class or path/to/file.py:Class.")
        if en.max_turns < 1:
            p.append(f"env.max_turns={en.max_turns} must be >= 1.")
        if en.fn is not None and algo.kind != "rl":
            p.append(f"env.fn is for RL runs; algo.kind is {algo.kind!r}: remove env.fn.")
        if en.fn is not None and algo.kind == "rl" and algo.dynamic_sampling:
            p.append("env.fn with algo.dynamic_sampling=true is not supported: set algo.dynamic_sampling=false.")
        if en.fn is not None and ev is not None and ev.every > 0:
            p.append("env.fn with eval.every > 0 is not supported (evaluation is single-turn): set eval.every=0.")
    _choice(p, "mode", s["mode"], ("run", "plan"))
    return p


def _is(value: Any, options: tuple[Any, ...]) -> bool:
    """``value`` is one of ``options`` with its type too (True is not the ZeRO stage 1)."""
    return any(value == o and type(value) is type(o) for o in options)


def _auto_bool(p: list[str], key: str, value: Any, auto_means: str) -> bool:
    """Whether ``value`` is auto, true or false; else a problem naming ``key`` and those three."""
    if _is(value, ("auto", True, False)):
        return True
    p.append(f"{key}={value!r} is not valid. Use auto ({auto_means}), true or false.")
    return False


def _train_memory_problems(p: list[str], s: dict[str, Any]) -> None:
    """train.zero_stage / offload_optimizer / max_tokens_per_micro_batch, placement.offload_train_state."""
    train, rollout, pl = s["train"], s["rollout"], s["placement"]
    if not _is(train.zero_stage, ("auto", 0, 1, 2, 3)):
        p.append(f"train.zero_stage={train.zero_stage!r} is not a ZeRO stage. Use auto (the plan picks), 0, 1, 2 or 3.")
    if _auto_bool(p, "train.offload_optimizer", train.offload_optimizer, "on only when the training memory needs it") \
            and train.offload_optimizer is True and _is(train.zero_stage, (0,)):
        p.append(
            "train.offload_optimizer=true needs ZeRO (DeepSpeed offloads the optimizer state of ZeRO "
            "stages 1-3), but train.zero_stage=0. Use train.zero_stage=2 or 3 (or auto), or train.offload_optimizer=false."
        )
    _auto_bool(p, "train.compile_logprobs", train.compile_logprobs, "on for CUDA runs")
    _auto_bool(p, "placement.offload_train_state", pl.offload_train_state,
               "offload only when the training states and vLLM do not fit side by side")
    budget = train.max_tokens_per_micro_batch
    seq = sequence_tokens(s["algo"], s["data"], rollout)
    if budget is not None and s["algo"].kind != "rl":
        p.append(
            f"train.max_tokens_per_micro_batch={budget} is read by RL passes only: algo={s['algo'].name} runs "
            "train.micro_batch_size units of up to data.max_length tokens a pass. Leave it null, and set "
            "train.micro_batch_size or data.max_length instead."
        )
    elif budget is not None and (budget < 1 or budget < seq):
        p.append(
            f"train.max_tokens_per_micro_batch={budget} is less than one sequence (rollout.max_prompt_tokens + "
            f"rollout.max_response_tokens = {seq} tokens). Use train.max_tokens_per_micro_batch={seq} or more, "
            f"or null (= train.micro_batch_size × {seq})."
        )


def _lora_problems(p: list[str], s: dict[str, Any]) -> None:
    """model.lora: LoRA adapters on the policy (rlhf.models.lora)."""
    lora, algo = s["model"].lora, s["algo"]
    if lora.rank < 0:
        p.append(f"model.lora.rank={lora.rank} must be >= 0 (0 = off, every weight trains; 8 or 16 is usual).")
    if lora.rank <= 0:
        return
    if lora.alpha <= 0:
        p.append(f"model.lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha / rank; "
                 f"{2 * lora.rank} is usual).")
    if not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout={lora.dropout} must be in [0, 1) (0 is usual for RL).")
    if not lora.target_modules:
        p.append("model.lora.target_modules is empty: name the Linear modules to adapt, e.g. "
                 "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj].")
    if algo.kind not in LORA_KINDS:
        p.append(f"model.lora.rank={lora.rank}: LoRA trains causal-LM policies ({', '.join(LORA_KINDS)}); "
                 f"algo={algo.name} trains a sequence classifier. Set model.lora.rank=0.")


def _nearest(candidates: list[int], target: int) -> list[int]:
    """The closest candidate below and above ``target`` (one value if it is the same)."""
    below = [c for c in candidates if c <= target]
    above = [c for c in candidates if c >= target]
    out = []
    if below:
        out.append(max(below))
    if above and min(above) not in out:
        out.append(min(above))
    return out


def _or(values: list[int]) -> str:
    return " (or ".join(str(v) for v in values) + (")" if len(values) > 1 else "")


def _batch_problems(s: dict[str, Any], roles: tuple[str, ...]) -> list[str]:
    """The batch math of one step: samples → mini-batches → ranks → micro-batches must divide evenly."""

    algo, train = s["algo"], s["train"]
    world = plan_layout(s, roles).world_size("actor")
    group = getattr(algo, "group_size", 1)
    prompts = train.prompts_per_step
    samples = prompts * group
    set_mini = getattr(algo, "mini_batch_size", None)
    mini = set_mini or samples
    what = (
        f"train.prompts_per_step={prompts} × algo.group_size={group} = {samples} samples"
        if algo.kind == "rl" else f"train.prompts_per_step={prompts} examples"
    )
    # prompts_per_step values near the current one whose samples split over the ranks
    ok_prompts = [q for q in range(1, 4 * prompts + world + 1) if (q * group) % world == 0]
    p = []
    if set_mini is not None and (set_mini < 1 or samples % set_mini):
        near = [d for d in divisors(samples) if d % world == 0]
        fix = (f"Use algo.mini_batch_size={_or(_nearest(near, set_mini))}" if near
               else f"Use train.prompts_per_step={_or(_nearest(ok_prompts, prompts))}")
        p.append(f"algo.mini_batch_size={set_mini} does not divide the {what} of a step. {fix}.")
    elif mini % world:
        if set_mini is not None:
            near = [d for d in divisors(samples) if d % world == 0]
            fix = (f"algo.mini_batch_size={_or(_nearest(near, set_mini))}" if near
                   else f"train.prompts_per_step={_or(_nearest(ok_prompts, prompts))}")
        else:
            fix = f"train.prompts_per_step={_or(_nearest(ok_prompts, prompts))}"
        p.append(
            f"the {mini} samples of an optimizer step ({what}) do not split evenly over the actor's "
            f"{world} data-parallel ranks. Use {fix}."
        )
    else:
        per_rank = mini // world
        micro = min(train.micro_batch_size, per_rank)
        if per_rank % micro:
            ok = [d for d in divisors(per_rank) if d <= train.micro_batch_size]
            p.append(
                f"train.micro_batch_size={train.micro_batch_size} does not divide the {per_rank} samples each of "
                f"the {world} ranks takes per optimizer step ({mini} / {world}). "
                f"Use train.micro_batch_size={max(ok)}."
            )
    return p
