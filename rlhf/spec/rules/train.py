"""The train section: steps, the batch math of one step, and the memory settings (ZeRO, offload,
the packing budget, CUDA-only kernels)."""

from __future__ import annotations

from rlhf.placement.layout import divisors, plan_layout
from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import auto_bool, is_one_of
from rlhf.spec.tokens import sequence_tokens


def problems(s: Sections, roles: tuple[str, ...], batch_math: bool = True) -> list[str]:
    """train.*; ``batch_math`` False skips the batch math, which needs a valid placement."""
    train, p = s["train"], []
    if train.steps < 1:
        p.append(f"train.steps={train.steps} must be >= 1.")
    if train.prompts_per_step < 1 or train.micro_batch_size < 1:
        p.append(
            f"train.prompts_per_step={train.prompts_per_step}, train.micro_batch_size={train.micro_batch_size}: "
            "both must be >= 1."
        )
    elif batch_math:
        p.extend(batch_problems(s, roles))
    return p + memory_problems(s)


def memory_problems(s: Sections) -> list[str]:
    """train.zero_stage / offload_optimizer / max_tokens_per_micro_batch / compile_logprobs /
    expandable_segments, placement.offload_train_state / sleep_rollout."""
    train, rollout, pl, hw, p = s["train"], s["rollout"], s["placement"], s["hardware"], []
    for key, value, fix in (("train.compile_logprobs", train.compile_logprobs, "auto (on for CUDA runs) or false"),
                            ("train.expandable_segments", train.expandable_segments, "false")):
        if is_one_of(value, (True,)) and hw.accelerator != "cuda":  # CUDA's compiled kernels / allocator
            p.append(f"{key}=true needs a CUDA GPU, but hardware={hw.name} has none. Use {key}={fix}.")
    if not is_one_of(train.zero_stage, ("auto", 0, 1, 2, 3)):
        p.append(f"train.zero_stage={train.zero_stage!r} is not a ZeRO stage. Use auto (the plan picks), 0, 1, 2 or 3.")
    if auto_bool(p, "train.offload_optimizer", train.offload_optimizer, "on only when the training memory needs it") \
            and train.offload_optimizer is True and is_one_of(train.zero_stage, (0,)):
        p.append(
            "train.offload_optimizer=true needs ZeRO (DeepSpeed offloads the optimizer state of ZeRO "
            "stages 1-3), but train.zero_stage=0. Use train.zero_stage=2 or 3 (or auto), or train.offload_optimizer=false."
        )
    auto_bool(p, "train.compile_logprobs", train.compile_logprobs, "on for CUDA runs")
    auto_bool(p, "placement.offload_train_state", pl.offload_train_state,
              "offload only when the training states and vLLM do not fit side by side")
    auto_bool(p, "placement.sleep_rollout", pl.sleep_rollout, "asleep during training unless algo.async_steps > 0 or the memory fits them awake")
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
    return p


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


def batch_problems(s: Sections, roles: tuple[str, ...]) -> list[str]:
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
