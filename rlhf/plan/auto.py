"""Settings the spec build decides from the plan's memory figures (``auto``) or from other settings.

``resolve`` runs in ``rlhf.spec.build`` after validation and before freezing, on the not yet frozen
spec: the frozen spec holds plain values (workers never see ``auto``), and ``RunSpec.auto`` records
each decision with a one-line reason for the plan. ``config_dict`` writes the given value back
(``auto`` / null), so a rerun of a saved config decides again from its own hardware.

- ``train.max_tokens_per_micro_batch`` null: on CPU micro-batch samples × the longest sequence (the
  CPU runs' passes, and the numbers their tests compare, as they always were); on GPUs the largest
  power of two up to ``MAX_AUTO_TOKENS`` (32,768), never below that product, at which every GPU
  figure still fits with the states where the other decisions put them (decided last): at 0.5B a
  16k budget's update is 0.77× a 32k one's speed, 64k no faster (BENCHMARKS §12). Where that product
  would put Adam's state in host memory (``train.offload_optimizer`` auto), the largest power of two
  below it, down to 8,192 tokens, at which the optimizer stays on the GPU instead: at 1.5B the host's
  optimizer halved the update's MFU (BENCHMARKS §8, twenty-eighth session). For sft/rm/dpo,
  which do not pack by it, always the most their micro-batch holds (rlhf.spec.tokens).
- ``train.zero_stage`` auto: 0 on CPU; on GPUs with one data-parallel rank per trained role ZeRO-1
  (ZeRO-2's gradient hooks partition nothing there and cost ~11 % of the update: 0.77 s against
  0.69 s, 28.3 % MFU against 31.6 % at 0.5B, BENCHMARKS §12), or ZeRO-2 when the optimizer goes to host memory (DeepSpeed's
  CPU Adam path as tested); from two ranks ZeRO-2, or ZeRO-3 when the training figures do not fit
  at ZeRO-2. At one rank ZeRO-3 shards nothing and only adds a gather to every pass.
- ``train.offload_optimizer`` auto: on only when the training figures do not fit with Adam's state
  on the GPU (it needs ZeRO >= 1).
- ``model.liger_kernels`` auto: on for CUDA runs when the ``liger-kernel`` package can be imported
  (the driver's environment is the workers') and Liger covers the checkpoint's ``model_type``. A
  type the driver cannot read yet (a Hub id not downloaded) is left to the workers: on, and a type
  Liger does not cover then runs without.
- ``model.compile_layers`` auto (decided after Liger's): on for RL runs on CUDA whose layers would
  otherwise run eagerly (Liger's kernels off: not installed, not covering the model, or set false),
  without LoRA or activation checkpointing, below ZeRO-3 and with the training states kept on the
  GPU (optimizer and hybrid's states not offloaded) — in the GRPO loop at 0.5B the compiled
  layers (rlhf.models.compiled) made the update 1.31× faster than eager ones (BENCHMARKS §12). Off
  where Liger's kernels are on (compiled layers measured 1.12× them, under the 1.25× a default must
  win by). ``true`` is the opt-in everywhere else, and turns ``model.liger_kernels`` auto off (dynamo
  cannot trace Liger's kernels in a compiled layer).
- ``train.compile_logprobs`` auto: on for CUDA runs (inductor's fused kernels for the LM head's
  chunk passes; measured 1.43× on the actor's forward+backward at 0.5B, BENCHMARKS §6).
- ``placement.sleep_rollout`` auto: the engines sleep while the models beside them train, unless
  ``algo.async_steps`` > 0 has them generate the next step during the update (``overlaps_update``):
  then vLLM stays awake through the training phase, which must hold both (the plan's fit check).
  ZeRO and optimizer offload are then decided as for the synchronous run, with the engine asleep:
  DeepSpeed does not move its states to the host to make room for an engine that async keeps awake.
  A synchronous run's engines also stay awake where the training phase holds them awake beside
  everything else as decided (``_stay_awake``, decided last: it gives up no token budget, ZeRO
  stage or engine for it): each step then skips the sleep, both wake-ups and the trainers' cache
  release (0.5B on an H200: that phase 0.29 → 0.05 s a step, the update 0.76 → 0.70 s, BENCHMARKS §4).
- ``placement.offload_train_state`` auto: in hybrid placement on GPUs, the training states stay on
  the GPU while vLLM generates when both phases fit that way; otherwise they move to host memory.
  With async rollouts they stay: the engines generate while the update runs, not between updates.
- ``placement.rollout.engines_per_device`` auto: the engine kind's ``auto_engines_per_device`` (vLLM:
  2) for a model of at most SHARED_ENGINES_MAX_PARAMS parameters at tensor_parallel 1 on CUDA, when
  ``placement.rollout.engines`` is left at 0, each engine's KV cache holds its share of a step's
  sequences, and every memory figure still fits with the other decisions as made; else 1. Decided
  last, so it changes none of the others: the extra engine is taken only where it fits beside them.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from rlhf.placement.layout import plan_layout
from rlhf.rollout import registry as engines
from rlhf.rollout.registry import DTYPE_BYTES, GB
from rlhf.plan.memory import (HOST, Estimate, capacity, estimate, over_limit, overlaps_update, param_count,
                              smaller_shares, training_figure)
from rlhf.spec.runspec import Decision, RunSpec
from rlhf.spec.shape import model_type
from rlhf.spec.tokens import micro_batch_tokens, sequence_tokens

AUTO = "auto"
# Decoding of models up to this size leaves the GPU waiting on the engine's host side (0.5B on an
# H200: GPU busy 20 % of the kernel span, 2.3 ms of GPU in a 12.3 ms model step; BENCHMARKS §10).
# Two engines were measured in the loop at 0.5B (step 1.24x) and 1.5B (1.10x, the gain falling with
# size): the bound stays at what was measured.
SHARED_ENGINES_MAX_PARAMS = 2e9
# The largest token budget the GPU auto picks: at 0.5B on an H200 the update's speed rises from 16k to
# 32k tokens per micro-batch (1.30×) and not beyond (64k: 1.00×, twice the activations; BENCHMARKS §12).
MAX_AUTO_TOKENS = 32_768
# The smallest budget the GPU auto goes down to, below micro-batch samples × the longest sequence, to
# keep Adam's state on the GPU: at 1.5B on an H100 the loop's update ran at 47 % MFU at 8,192 tokens
# with the optimizer on the GPU (BENCHMARKS §8); smaller passes were not measured against the host's optimizer.
MIN_ON_GPU_TOKENS = 8_192


def _what(name: str) -> str:
    return f"the {name}" if name.endswith("phase") else f"each {name} GPU"


def worst_training_figure(est: Estimate) -> tuple[str, float]:
    """The training figure (hybrid training phase, or a training role) with the most GB."""
    totals = {k: v for k, v in est.totals.items() if training_figure(k)}
    name = max(totals, key=totals.get)
    return name, totals[name]


def resolve(spec: RunSpec) -> tuple[Decision, ...]:
    """Replace every ``auto`` / null of the (unfrozen) spec by a value; return the decisions."""
    out = []
    train = spec.train
    # sft/rm/dpo always: validation refused a set value, and the plan sizes their passes by this
    if train.max_tokens_per_micro_batch is None or spec.algo.kind != "rl":
        train.max_tokens_per_micro_batch, why = micro_batch_tokens(spec.algo, spec.batch.micro_batch_size,
                                                                   spec.data, spec.rollout)
        out.append(Decision("train.max_tokens_per_micro_batch", None, train.max_tokens_per_micro_batch, why))
    if spec.rollout.seeded is None:
        spec.rollout.seeded = engines.kind(spec).seeded
        out.append(Decision("rollout.seeded", None, spec.rollout.seeded,
                            "" if spec.rollout.seeded else f"{spec.rollout_engine} samples unseeded requests in one batch"))
    if spec.model.liger_kernels == AUTO:  # before compiled layers: those are taken where Liger is not
        spec.model.liger_kernels, why = _liger(spec)
        out.append(Decision("model.liger_kernels", AUTO, spec.model.liger_kernels, why))
    compile_auto = spec.model.compile_layers == AUTO
    if compile_auto:
        spec.model.compile_layers, why = _compile_layers(spec)
        out.append(Decision("model.compile_layers", AUTO, spec.model.compile_layers, why))
    if spec.train.compile_logprobs == AUTO:
        spec.train.compile_logprobs = spec.hardware.accelerator == "cuda"
        out.append(Decision("train.compile_logprobs", AUTO, spec.train.compile_logprobs,
                            "" if spec.train.compile_logprobs else "CPU run"))
    out.extend(_sleep_rollout(spec))  # first: the training figures count what the engine keeps
    placed = _states(spec)
    if out and out[0].key == "train.max_tokens_per_micro_batch" and spec.algo.kind == "rl" \
            and spec.hardware.accelerator == "cuda":
        base = out[0]
        smaller = _budget_keeping_the_optimizer(spec, base, placed)
        if smaller is not None:  # states decided again at it: Adam's state on the GPU
            out[0], placed = smaller
        else:
            out[0] = _token_budget(spec, base)
            if out[0].value != base.value and placed:
                # decided again at the chosen budget: the same values (a larger budget only adds memory,
                # and the values decided at the smaller one fit at it), the reasons' figures as planned
                placed = _states_again(spec, placed)
    unmeasured = compile_auto and spec.model.compile_layers and _compile_unmeasured(spec)
    if unmeasured:  # where the states went (decided above) was not measured with compiled layers
        spec.model.compile_layers = False  # no figure changes: compiled layers are planned as eager ones
        i = next(i for i, d in enumerate(out) if d.key == "model.compile_layers")
        out[i] = Decision("model.compile_layers", AUTO, False, f"{unmeasured}; model.compile_layers=true")
    out = out + placed + _engines_per_device(spec)  # after the rest: taken only where it fits beside them
    return tuple(_stay_awake(spec, out))  # last: the engines kept awake only where every other choice still fits


def _states(spec: RunSpec) -> list[Decision]:
    """Where the training states live: the ZeRO stage, optimizer offload, hybrid's offload while vLLM generates."""
    # DeepSpeed makes the synchronous run's choices: it does not offload to make room for an engine
    # that async keeps awake (the plan's fit check says whether both fit, and what to lower), so its
    # figures are read with the engine asleep for that one decision
    awake = overlaps_update(spec)  # sleep_rollout resolved to false before
    if awake:
        spec.placement.sleep_rollout = True
    try:
        out = _zero_and_offload(spec)
    finally:
        if awake:
            spec.placement.sleep_rollout = False
    return out + _train_state(spec)


def _states_again(spec: RunSpec, placed: list[Decision]) -> list[Decision]:
    """The states' decisions (``placed``) back to auto and decided again, at the spec's budget now."""
    for d in placed:
        section, key = d.key.split(".")
        setattr(getattr(spec, section), key, d.given)
    return _states(spec)


def _token_budget(spec: RunSpec, base: Decision) -> Decision:
    """RL on GPUs, ``train.max_tokens_per_micro_batch`` null: from today's budget t₀ (micro-batch samples
    × the longest sequence, ``base``), the largest power of two t with t₀ < t ≤ MAX_AUTO_TOKENS at which
    no GPU figure is over the limit, the ZeRO stage, offloads and Liger as decided; else t₀. Larger
    packed passes keep the GPU's matmuls busy (fewer, bigger kernels); the plan's fit rule bounds them."""
    train = spec.train
    t0 = base.value
    if over_limit(spec, estimate(spec)).keys() - {HOST}:
        return base  # already over at t₀: the plan says what does not fit and what would
    tried = [1 << k for k in range(MAX_AUTO_TOKENS.bit_length() - 1, -1, -1) if t0 < 1 << k <= MAX_AUTO_TOKENS]
    why = base.why
    for t in tried:
        train.max_tokens_per_micro_batch = t
        est = estimate(spec)
        over = {k: v for k, v in over_limit(spec, est).items() if k != HOST}
        if not over:
            name, gb = worst_training_figure(est)
            why = (f"the largest power of two ≤ {MAX_AUTO_TOKENS} with {_what(name)} fitting ({gb:.0f} of "
                   f"{capacity(spec, name):.0f} GB usable); not below {base.why} = {t0}")
            return Decision(base.key, base.given, t, why)
        name, gb = max(over.items(), key=lambda kv: kv[1])
        why = f"{base.why}; {t} would make {_what(name)} {gb:.0f} GB of {capacity(spec, name):.0f} usable"
    train.max_tokens_per_micro_batch = t0
    return Decision(base.key, base.given, t0, why)


def _budget_keeping_the_optimizer(spec: RunSpec, base: Decision,
                                  placed: list[Decision]) -> Optional[tuple[Decision, list[Decision]]]:
    """RL on GPUs, the budget null, and ``train.offload_optimizer`` auto put Adam's state in host memory
    at today's budget t₀ (``base``): the largest power of two t with MIN_ON_GPU_TOKENS ≤ t < t₀ (and
    at least one sequence) at which the states, decided again there, keep it on the GPU; (the
    budget's decision, the states' decisions at t), or None with the states as they were at t₀.
    A smaller packed pass costs the update far less than the host's optimizer: at 1.5B on an H100,
    16,384 tokens with the optimizer on the host (DeepSpeed's CPU Adam at ZeRO-2, eager layers, as
    decided there) ran the update at 23 % MFU (6.1 s), against 47 % at 8,192 tokens with Adam on
    the GPU (BENCHMARKS §8, twenty-eighth session)."""
    if not any(d.key == "train.offload_optimizer" and d.value is True for d in placed):
        return None
    t0, seq = base.value, sequence_tokens(spec.algo, spec.data, spec.rollout)
    floor = max(MIN_ON_GPU_TOKENS, seq)
    states_moved = spec.placement.offload_train_state  # hybrid's states to the host each step, at t₀

    def decide_states_at(t: int) -> list[Decision]:
        spec.train.max_tokens_per_micro_batch = t
        return _states_again(spec, placed)

    t = 1 << ((t0 - 1).bit_length() - 1)  # the largest power of two below t₀
    while t >= floor:
        states = decide_states_at(t)
        # the optimizer on the GPU, every GPU figure fitting, and no offload of hybrid's states each step
        # that t₀ did not have (it would trade the host's optimizer for a host round trip a step)
        est = estimate(spec)
        if spec.train.offload_optimizer is False and spec.placement.offload_train_state <= states_moved \
                and not (over_limit(spec, est).keys() - {HOST}):
            name, gb = worst_training_figure(est)
            why = (f"the largest power of two below {base.why} = {t0} at which Adam's state stays on the GPU "
                   f"({_what(name)} {gb:.0f} of {capacity(spec, name):.0f} GB usable): the optimizer in host "
                   f"memory ran the update at half the MFU (1.5B, BENCHMARKS §8)")
            return Decision(base.key, base.given, t, why), states
        t //= 2
    decide_states_at(t0)  # none: the states as they were, at t₀
    return None


def _liger(spec: RunSpec) -> tuple[bool, str]:
    """``model.liger_kernels`` auto: (on, why)."""
    if spec.hardware.accelerator != "cuda":
        return False, ""  # Triton kernels: nothing to decide, nothing for the plan to say
    if spec.model.compile_layers is True:
        return False, ("model.compile_layers=true: inductor fuses the norms and MLP in the compiled layers, and "
                       "dynamo cannot trace Liger's kernels there")
    if importlib.util.find_spec("liger_kernel") is None:
        return False, LIGER_NOT_INSTALLED
    kind = model_type(spec.model.path, spec.model.revision)
    if kind is None:
        return True, ("the liger-kernel package is installed; the model_type is not known before the download "
                      "(a type Liger does not cover runs without)")
    return liger_coverage(kind)


LIGER_NOT_INSTALLED = "the liger-kernel package is not installed"


def _compile_layers(spec: RunSpec) -> tuple[bool, str]:
    """``model.compile_layers`` auto: (on, why). Decided after Liger's auto: on for an RL run on CUDA whose
    layers would otherwise run eagerly (Liger off), without LoRA or activation checkpointing, below
    ZeRO-3 and with the training states on the GPU (what was measured; ZeRO and offloads are decided
    after this, and ``resolve`` turns it off again where they land elsewhere). In the GRPO loop at 0.5B on an H200 the compiled layers made the update
    1.31× faster than eager ones (1.01 → 0.77 s, MFU 24.6 → 32.4 %; the update alone 1.41×), against
    Liger's kernels only 1.12× (the update alone), under the 1.25× a default must win by (BENCHMARKS §12)."""
    m = spec.model
    if spec.hardware.accelerator != "cuda":
        return False, ""  # CPU runs trace the layers only (aot_eager): no speed to win
    if m.liger_kernels is True:
        return False, ("Liger's kernels are on: compiled layers measured 1.12× them at 0.5B, under the 1.25× a "
                       "default needs (BENCHMARKS §12); model.compile_layers=true takes them instead")
    why = None
    if spec.algo.kind != "rl":
        why = f"algo={spec.algo.name}: measured in the RL loop only"
    elif m.lora.rank > 0:
        why = "LoRA adapters: not measured with compiled layers"
    elif m.gradient_checkpointing:
        why = "activation checkpointing: not measured with compiled layers"
    else:
        why = _compile_unmeasured(spec)
    if why:
        return False, f"{why}; model.compile_layers=true"
    return True, ("Liger's kernels are off and eager layers would run: compiled, the GRPO loop's update was 1.31× "
                  "faster at 0.5B (BENCHMARKS §12; the first passes pay ~14 s of compilation); "
                  "model.compile_layers=false runs them eagerly")


def _compile_unmeasured(spec: RunSpec) -> Optional[str]:
    """Where the training states go, when compiled layers were not measured there (a set value, or
    ``auto`` once decided): ZeRO-3, the optimizer on the host, hybrid's states offloaded each step."""
    if spec.train.zero_stage == 3:
        return "ZeRO-3 gathers each layer's parameters in hooks around it: not measured with compiled layers"
    if spec.train.offload_optimizer is True:
        return "the optimizer on the host: not measured with compiled layers"
    if spec.placement.offload_train_state is True:
        return "the training states leave the GPU each step: not measured with compiled layers"
    return None


def liger_coverage(kind: Optional[str]) -> tuple[bool, str]:
    """Whether Liger's kernels apply to a model of transformers ``model_type`` ``kind`` in this
    process (the package imports and its table lists the type), and why, as a phrase. The driver's
    auto choice and the worker that applies the kernels (``rlhf.models.load.apply_liger``) both ask
    here. Imports the package, and torch and Triton with it, unless it is not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        return False, LIGER_NOT_INSTALLED
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # noqa: BLE001 - a broken install (a missing or mismatched dependency)
        return False, f"the liger-kernel package cannot be imported ({type(e).__name__})"
    if kind in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return True, f"Liger has kernels for model_type={kind!r}"
    return False, f"Liger has no kernels for model_type={kind!r}"


def chosen(spec: RunSpec, key: str) -> bool:
    """Whether the build decided ``key`` (it was auto / null in the config)."""
    return any(d.key == key for d in spec.auto)


def dp_ranks(spec: RunSpec) -> int:
    """The most data-parallel ranks of a trained role (the actor; the critic may have its own count
    in disaggregated placement): one ``train.zero_stage`` serves them all."""
    return max((spec.layout.world_size(r) for r in ("actor", "critic") if r in spec.roles),
               default=spec.batch.train_world_size)


def _zero_and_offload(spec: RunSpec) -> list[Decision]:
    train = spec.train
    z_auto, off_auto = train.zero_stage == AUTO, train.offload_optimizer == AUTO
    if not (z_auto or off_auto):
        return []
    cuda = spec.hardware.accelerator == "cuda"
    ranks = spec.batch.train_world_size
    one_rank = dp_ranks(spec) == 1
    if not z_auto:
        stages = [train.zero_stage]
    elif not cuda:
        stages = [2] if train.offload_optimizer is True else [0]
    else:
        stages = [1, 2] if one_rank else [2, 3]
    offloads = [train.offload_optimizer] if not off_auto else [False, True] if cuda else [False]
    # Preference: the first that fits. A sharded model over several ranks is faster than Adam on the
    # host, so every stage is tried without offload first. Nothing fits: the most saving one. At one
    # rank ZeRO-1 and ZeRO-2 hold the same memory: ZeRO-1 without offload, ZeRO-2 with it.
    candidates = [(z, off) for off in offloads for z in stages if not (off and z == 0)
                  and not (z_auto and cuda and one_rank and (z == 1) == off)]
    cap = capacity(spec, "training phase")  # every GPU figure's
    need: dict[tuple[int, bool], tuple[str, float, Estimate]] = {}

    def host_fits(est: Estimate) -> bool:
        return not est.host or est.total(HOST) <= capacity(spec, HOST)

    chosen = None
    for z, off in candidates:
        train.zero_stage, train.offload_optimizer = z, off
        est = estimate(spec)
        need[(z, off)] = (*worst_training_figure(est), est)
        if not cuda or (need[(z, off)][1] <= cap and host_fits(est)):
            chosen = (z, off)
            break
    if chosen is None:  # nothing fits: the most saving one the host can hold (the plan says what fails)
        chosen = next((c for c in reversed(candidates) if host_fits(need[c][2])), candidates[-1])
    train.zero_stage, train.offload_optimizer = chosen
    z, off = chosen
    name, gb, est = need[chosen]
    fits = not cuda or gb <= cap
    out = []
    if z_auto:
        if not cuda:
            why = "optimizer offload needs ZeRO" if off else "CPU run"
        elif one_rank and z == 1:
            why = ("1 rank: ZeRO-2's gradient hooks would partition nothing (its update 1.12× slower at 0.5B, "
                   "BENCHMARKS §12); ZeRO-3 only shards over several ranks")
        elif one_rank:
            why = "1 rank, the optimizer in host memory (DeepSpeed's CPU Adam, as at ZeRO-2 from two ranks)"
        elif z == 2 and fits:
            why = f"{_what(name)} fits at ZeRO-2 ({gb:.0f} of {cap:.0f} GB usable); ZeRO-3 would gather weights every pass"
        elif z == 3:
            first = need.get((2, off)) or need.get((2, False))
            why = (f"at ZeRO-2 {_what(first[0])} needs {first[1]:.0f} GB of {cap:.0f} usable; ZeRO-3 shards the "
                   f"weights over {ranks} ranks" if first else f"{ranks} ranks")
        else:
            why = f"{ranks} ranks"
        out.append(Decision("train.zero_stage", AUTO, z, why))
    if off_auto:
        why = ""

        def tried(offloaded: bool):  # the same stage the other way; at one rank ZeRO-1 / ZeRO-2 (the same memory)
            return need.get((z, offloaded)) or next((v for (_, o), v in need.items() if o == offloaded), None)

        on_gpu, on_host = tried(False), tried(True)
        if off and on_gpu:
            wname, wgb, west = on_gpu
            opt = sum(v for k, v in west.figures[wname].items() if k.endswith("optimizer"))
            why = (f"Adam's state ({opt:.0f} GB per GPU) in host memory: on the GPU {_what(wname)} would need "
                   f"{wgb:.0f} GB of {cap:.0f} usable")
        elif not off and on_host and not host_fits(on_host[2]):
            hest = on_host[2]
            why = (f"offloaded, Adam's state would make the host memory {hest.total(HOST):.0f} GB per node of "
                   f"{capacity(spec, HOST):.0f} usable")
        out.append(Decision("train.offload_optimizer", AUTO, off, why))
    return out


def _sleep_rollout(spec: RunSpec) -> list[Decision]:
    """``placement.sleep_rollout`` auto, first: asleep during training unless the engines generate then
    (async rollouts), so the training figures the next decisions read count an engine asleep;
    ``_stay_awake`` may wake it last. The reason is printed only where async keeps it awake."""
    pl = spec.placement
    if pl.sleep_rollout != AUTO:
        return []
    k = getattr(spec.algo, "async_steps", 0)
    pl.sleep_rollout = k <= 0
    why = f"algo.async_steps={k}: the engines sample the next step during the update" \
        if k > 0 and _engine_beside_training(spec) else ""
    return [Decision("placement.sleep_rollout", AUTO, pl.sleep_rollout, why)]


def _stay_awake(spec: RunSpec, decided: list[Decision]) -> list[Decision]:
    """``placement.sleep_rollout`` auto on a synchronous run whose engines would sleep beside the
    trained roles: awake instead when every figure still fits with them awake through the training
    phase (their whole share, ``EngineKind.resident_while_training``). Sleeping costs every step a
    sleep, two wake-ups and the trainers' cache release; the memory it frees is then not needed.
    ``decided`` with that decision's value and reason replaced (a reason only where the run fits)."""
    i = next((i for i, d in enumerate(decided) if d.key == "placement.sleep_rollout"), None)
    if i is None or not spec.placement.sleep_rollout or not _engine_beside_training(spec) \
            or over_limit(spec, estimate(spec)):
        return decided
    spec.placement.sleep_rollout = False
    est = estimate(spec)
    if over_limit(spec, est):
        spec.placement.sleep_rollout = True
        why = (f"awake beside the update, the engines would make the training phase {est.total('training phase'):.0f} "
               f"GB of {capacity(spec, 'training phase'):.0f} usable{_awake_share(spec)}")
    else:
        why = (f"the training phase holds the engines awake beside the update ({est.total('training phase'):.0f} of "
               f"{capacity(spec, 'training phase'):.0f} GB usable): no sleep and wake-up each step")
    return decided[:i] + [Decision("placement.sleep_rollout", AUTO, spec.placement.sleep_rollout, why)] + decided[i + 1:]


def _awake_share(spec: RunSpec) -> str:
    """The largest smaller vLLM share (``memory.smaller_shares``) at which the engines would stay
    awake with each engine's KV cache still holding its sequences of a step (at tensor_parallel 1),
    as a clause of the reason; "" if none."""
    u, n = spec.rollout.gpu_memory_utilization, spec.layout.engines_per_device
    if spec.layout.rollout_tp != 1:
        return ""
    weights = engines.kind(spec).gpu_memory(spec, param_count(spec.model)).get("vLLM weights", 0.0)
    spec.placement.sleep_rollout = False
    try:
        for share in smaller_shares(spec, weights):
            spec.rollout.gpu_memory_utilization = share
            kv, _, need = kv_room(spec, n)
            if kv >= need and not over_limit(spec, estimate(spec)):
                return f"; rollout.gpu_memory_utilization={share:g} would keep them awake"
        return ""
    finally:
        spec.rollout.gpu_memory_utilization = u
        spec.placement.sleep_rollout = True


def _engine_beside_training(spec: RunSpec) -> bool:
    """The run's rollout engines share GPUs with the trained roles and can sleep there."""
    return (spec.hardware.accelerator == "cuda" and "rollout" in spec.roles and spec.layout.rollout_beside_training
            and engines.kind(spec).sleeps)


def _train_state(spec: RunSpec) -> list[Decision]:
    pl = spec.placement
    if pl.offload_train_state != AUTO:
        return []
    if not (spec.layout.one_pool and spec.hardware.accelerator == "cuda" and "rollout" in spec.roles):
        pl.offload_train_state = True  # no generation phase shares these GPUs: nothing to decide
        return [Decision("placement.offload_train_state", AUTO, True, "")]
    if overlaps_update(spec):  # the engines generate during the update: offloading would not make them room
        pl.offload_train_state = False
        return [Decision("placement.offload_train_state", AUTO, False,
                         f"algo.async_steps={spec.algo.async_steps}: the engines generate while the update runs")]
    cap = capacity(spec, "generation phase")  # every GPU figure's
    pl.offload_train_state = False
    est = estimate(spec)
    gen = est.total("generation phase")
    name, train_gb = worst_training_figure(est)
    if gen <= cap and train_gb <= cap:
        why = (f"the generation phase fits with the training states resident ({gen:.0f} of {cap:.0f} GB "
               "usable): no offload and reload each step")
        return [Decision("placement.offload_train_state", AUTO, False, why)]
    pl.offload_train_state = True
    why = (f"resident, the training states would make the generation phase {gen:.0f} GB of {cap:.0f} usable"
           if gen > cap else f"{_what(name)} does not fit (below)")
    return [Decision("placement.offload_train_state", AUTO, True, why)]


def relayout(spec: RunSpec) -> None:
    """The (unfrozen) spec's layout again from its placement (after engines_per_device changed)."""
    spec.layout = plan_layout({"hardware": spec.hardware, "placement": spec.placement}, spec.roles)


def kv_bytes_per_token(spec: RunSpec) -> int:
    """Bytes of KV cache per token: keys and values of every layer, 2·L·K·(h/H)·b."""
    m = spec.model
    return 2 * m.n_layers * m.n_kv_heads * (m.hidden // m.n_heads) * DTYPE_BYTES[m.dtype]


def kv_room(spec: RunSpec, n: int) -> tuple[float, int, float]:
    """With ``n`` engines per GPU at tensor_parallel 1: each engine's KV cache (its part of vLLM's share
    less its weights, GB), the step's sequences it generates, and the GB their full lengths need."""
    share = spec.rollout.gpu_memory_utilization * spec.hardware.device_memory_gb / n
    weights = DTYPE_BYTES[spec.model.dtype] * param_count(spec.model) / GB
    seqs = -(-spec.batch.samples_per_step // (len(spec.layout.rollout_devices) * n))
    need = seqs * (spec.rollout.max_prompt_tokens + spec.rollout.max_response_tokens) * kv_bytes_per_token(spec) / GB
    return share - weights, seqs, need


def _engines_per_device(spec: RunSpec) -> list[Decision]:
    """``placement.rollout.engines_per_device`` auto: (see the module's docstring)."""
    rollout = spec.placement.rollout
    if rollout.engines_per_device != AUTO:
        return []
    rollout.engines_per_device = 1
    want = engines.kind(spec).auto_engines_per_device if "rollout" in spec.roles else 1
    if spec.hardware.accelerator != "cuda" or want <= 1:
        return [Decision("placement.rollout.engines_per_device", AUTO, 1, "")]
    params = param_count(spec.model)
    why = None
    if rollout.tensor_parallel > 1:
        why = f"tensor_parallel={rollout.tensor_parallel}: an engine takes several GPUs"
    elif params > SHARED_ENGINES_MAX_PARAMS:
        why = (f"{params / 1e9:.1f}B parameters: decoding keeps the GPU busy (engines share GPUs only up to "
               f"{SHARED_ENGINES_MAX_PARAMS / 1e9:.0f}B)")
    elif rollout.engines:
        why = f"placement.rollout.engines={rollout.engines} sets the engines"
    if why is None:
        kv, seqs, need = kv_room(spec, want)
        if kv < need:
            why = (f"{want} engines per GPU would leave each {max(kv, 0):.1f} GB of KV cache, less than "
                   f"its {seqs} sequences need ({need:.1f} GB)")
    if why is None:
        rollout.engines_per_device = want
        relayout(spec)
        est = estimate(spec)
        over = over_limit(spec, est)
        if over:
            name, gb = next(iter(over.items()))
            why = f"with {want} engines per GPU the {name} would need {gb:.0f} GB of {capacity(spec, name):.0f} usable"
            rollout.engines_per_device = 1
            relayout(spec)
        else:
            why = (f"{params / 1e9:.1f}B parameters at tensor_parallel 1: decoding is host-bound, {want} engines "
                   f"per GPU keep it busier (the RL step 1.24x faster at 0.5B, 1.10x at 1.5B, BENCHMARKS §10); the memory fits")
    return [Decision("placement.rollout.engines_per_device", AUTO, rollout.engines_per_device, why)]
