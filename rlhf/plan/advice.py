"""What to change when a plan does not fit, as settings checked by building them.

A suggestion is one or more KEY=VALUE overrides (or a hardware group, ``hardware=<option>``).
``suggestions`` builds the spec with each candidate applied — the same validation and ``auto``
decisions as the command line — and keeps those that build and make the figure fit or at least
smaller; ``setting_that_fits`` applies them one after another until every figure fits. So each
printed suggestion is a setting that works, and the plan can name one that fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence

from rlhf.rollout import registry as engines
from rlhf.plan.memory import (
    DTYPE_BYTES,
    GB,
    HOST,
    training_figure,
    Estimate,
    capacity,
    estimate,
    fits,
    min_gpus,
    over_limit,
    param_count,
    smaller_shares,
)
from rlhf.spec.runspec import RunSpec
from rlhf.spec.tokens import sequence_tokens

LORA_RANK = 16  # what the plan suggests: a usual rank, alpha twice it
MAX_DEVICES_PER_NODE = 8


@dataclass
class Suggestion:
    overrides: tuple[str, ...]
    spec: RunSpec  # the built spec with the overrides applied
    total: float  # the figure's GB with them (0 when the figure is gone)
    fits: bool  # that figure fits


def _fmt(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _thaw(obj: Any) -> Any:
    """An unfrozen deep copy of a spec section (tuples back to lists, as the schemas have them)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = object.__new__(type(obj))
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _thaw(getattr(obj, f.name)))
        return new
    if isinstance(obj, (list, tuple)):
        return [_thaw(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _thaw(v) for k, v in obj.items()}
    return obj


@lru_cache(maxsize=None)
def _hardware_options() -> dict[str, dict]:
    import yaml

    from rlhf.paths import conf_dir

    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted((conf_dir() / "hardware").glob("*.yaml"))}


def apply(spec: RunSpec, overrides: Sequence[str]) -> Optional[RunSpec]:
    """The spec rebuilt with ``overrides`` (KEY=VALUE, or hardware=<option>); None if it does not build."""
    import yaml

    from rlhf.spec import schema as S
    from rlhf.spec.build import CONFIG_SECTIONS, build_sections
    from rlhf.spec.errors import SpecError

    sections = {k: _thaw(getattr(spec, k)) for k in CONFIG_SECTIONS}
    for d in spec.auto:  # decided again under the new settings
        *path, leaf = d.key.split(".")
        # except RL's token budget (rlhf.plan.auto._token_budget on GPUs): the memory a setting saves
        # would go to a larger budget, and the figure would not shrink; a suggestion may set it itself
        keep = d.key == "train.max_tokens_per_micro_batch" and spec.algo.kind == "rl"
        setattr(_get_sections(sections, path), leaf, d.value if keep else d.given)
    # a group option first, as Hydra applies it before KEY=VALUE overrides
    for ov in sorted(overrides, key=lambda o: "." in o.split("=", 1)[0]):
        key, value = ov.split("=", 1)
        if key == "hardware":
            sections["hardware"] = S.HardwareSpec(**_hardware_options()[value])
            continue
        *path, leaf = key.split(".")
        setattr(_get_sections(sections, path), leaf, yaml.safe_load(value))
    try:
        return build_sections(sections)
    except SpecError:
        return None


def _get_sections(sections: dict[str, Any], path: list[str]) -> Any:
    obj = sections[path[0]]
    for part in path[1:]:
        obj = getattr(obj, part)
    return obj


def _figure(est: Estimate, name: str) -> float:
    """Figure ``name``'s GB in ``est`` (0 when the figure is gone)."""
    if name == HOST:
        return est.total(HOST) if est.host else 0.0
    return est.total(name) if name in est.figures else 0.0


def _check(spec: RunSpec, name: str, overrides: Sequence[str]) -> Optional[Suggestion]:
    """``overrides`` as a suggestion for figure ``name``: None unless it builds and helps."""
    new = apply(spec, overrides)
    if new is None:
        return None
    total = _figure(estimate(new), name)
    before = _figure(estimate(spec), name)
    ok = total <= capacity(new, name)
    if not ok and total >= before - 0.05:
        return None
    return Suggestion(tuple(overrides), new, total, ok)


def lora_overrides(spec: RunSpec) -> Optional[list[str]]:
    """The overrides that train LoRA adapters (rank LORA_RANK, alpha twice it) instead of every
    weight; None when LoRA is on already or the algo kind takes none (``rlhf.spec.rules.model.LORA_KINDS``)."""
    from rlhf.spec.rules.model import LORA_KINDS

    if spec.model.lora.rank > 0 or spec.algo.kind not in LORA_KINDS:
        return None
    return [f"model.lora.rank={LORA_RANK}", f"model.lora.alpha={2 * LORA_RANK}"]


def _hardware(spec: RunSpec, nodes: int, per_node: int) -> list[str]:
    """Overrides for ``nodes`` × ``per_node`` of the same GPUs: a shipped hardware option, else keys."""
    hw = spec.hardware
    for name, h in _hardware_options().items():
        same = (h.get("accelerator"), h.get("device_memory_gb"), h.get("peak_bf16_tflops")) == (
            hw.accelerator, hw.device_memory_gb, hw.peak_bf16_tflops)
        if same and (h.get("nodes", 1), h.get("devices_per_node", 1)) == (nodes, per_node):
            return [f"hardware={name}"]
    out = [f"hardware.nodes={nodes}"] if nodes != hw.nodes else []
    if per_node != hw.devices_per_node:
        out.append(f"hardware.devices_per_node={per_node}")
        if hw.host_memory_gb > 0:  # a node with more GPUs has more host memory: the same per GPU
            out.append(f"hardware.host_memory_gb={hw.host_memory_gb * per_node / hw.devices_per_node:g}")
    return out


def _more_devices(spec: RunSpec, total: int) -> list[str]:
    """Overrides for ``total`` GPUs of the same kind, filling nodes of up to 8 first."""
    per_node = min(total, max(spec.hardware.devices_per_node, MAX_DEVICES_PER_NODE))
    return _hardware(spec, math.ceil(total / per_node), per_node)


def _candidates(spec: RunSpec, est: Estimate, name: str) -> list[list[str]]:
    """The settings worth trying for figure ``name``, cheapest change first (unchecked)."""
    train, m, pl, hw = spec.train, spec.model, spec.placement, spec.hardware
    decided = {d.key for d in spec.auto}
    out: list[list[str]] = []
    if name == HOST:  # the offloaded optimizer or training states, the model loads, the processes
        if train.offload_optimizer is True and "train.offload_optimizer" not in decided:
            out.append(["train.offload_optimizer=auto"])  # auto offloads only what the host holds
        if pl.offload_train_state is True and "placement.offload_train_state" not in decided:
            out.append(["placement.offload_train_state=false"])
        if lora := lora_overrides(spec):
            out.append(lora)
        total = spec.layout.total_devices
        for n in (2 * total, 4 * total, 8 * total):
            out.append(_more_devices(spec, n) + ["#devices"])
    elif training_figure(name):
        pinned = [k for k in ("train.zero_stage", "train.offload_optimizer") if k not in decided]
        auto = apply(spec, [f"{k}=auto" for k in pinned]) if pinned else None
        if auto is not None:  # what auto would pick instead of the pinned values
            out.append([f"{k}={_fmt(_get(auto, k))}" for k in pinned if _get(auto, k) != _get(spec, k)])
        if spec.layout.rollout_beside_training and not pl.sleep_rollout:
            if getattr(spec.algo, "async_steps", 0) > 0:
                # awake for async: a smaller share first (async keeps its overlap), then sleep; async_steps
                # is what keeps it awake under auto, otherwise the setting itself
                weights = engines.kind(spec).gpu_memory(spec, param_count(m)).get("vLLM weights", 0.0)
                for share in smaller_shares(spec, weights):
                    out.append([f"rollout.gpu_memory_utilization={share:g}", "#awake-share"])
                out.append(["algo.async_steps=0"] if "placement.sleep_rollout" in decided
                           else ["placement.sleep_rollout=true"])
            else:  # awake only to skip the sleep and wake-ups (rlhf.plan.auto._stay_awake): sleeping costs least
                out.append(["placement.sleep_rollout=true"])
        if name in ("training phase", "actor", "critic"):
            if not m.gradient_checkpointing:
                out.append(["model.gradient_checkpointing=true"])
            if spec.algo.kind == "rl":
                seq = sequence_tokens(spec.algo, spec.data, spec.rollout)
                k = train.max_tokens_per_micro_batch // seq
                while k > 1:  # the largest budget (whole sequences, halving) that fits, else one sequence
                    k //= 2
                    out.append([f"train.max_tokens_per_micro_batch={max(k, 1) * seq}", "#budget"])
            else:  # sft/rm/dpo passes hold micro_batch_size units (rlhf.spec.tokens): fewer per pass
                k = spec.batch.micro_batch_size
                while k > 1:
                    k //= 2
                    out.append([f"train.micro_batch_size={k}", "#budget"])
        if name in ("training phase", "actor") and (lora := lora_overrides(spec)):
            out.append(lora)
        total = spec.layout.total_devices
        need = max(min_gpus(spec, est, name), 2 * total)
        target = 1 << (need - 1).bit_length()
        for n in (target, 2 * target, 4 * target):
            out.append(_more_devices(spec, n) + ["#devices"])
    else:  # generation phase / rollout
        weights = est.figures[name].get("vLLM weights", 0.0)
        share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
        tp = engines.kind(spec).min_tensor_parallel(spec) if weights > share / 2 else 0
        if tp > spec.layout.rollout_tp:
            out.append([f"placement.rollout.tensor_parallel={tp}"])
            if not spec.layout.one_pool:  # the engines' GPUs come out of the others': more in all
                for n in (2, 4):
                    out.append(_more_devices(spec, n * spec.layout.total_devices)
                               + [f"placement.rollout.tensor_parallel={tp}", "#tp-devices"])
        elif weights > share / 2:
            full = DTYPE_BYTES[m.dtype] * param_count(m) / GB
            need = 1 << max(math.ceil(full / (share / 2)) - 1, 0).bit_length()
            out.append(_hardware(spec, hw.nodes, need) + [f"placement.rollout.tensor_parallel={need}"])
        if spec.layout.engines_per_device > 1 and "placement.rollout.engines_per_device" not in decided:
            out.append(["placement.rollout.engines_per_device=1"])  # one copy of the weights per GPU
        if spec.layout.rollout_beside_training and pl.offload_train_state is False and "placement.offload_train_state" not in decided:
            out.append(["placement.offload_train_state=true"])
        for share in smaller_shares(spec, weights):
            out.append([f"rollout.gpu_memory_utilization={share:g}", "#share"])
    return [c for c in out if [o for o in c if not o.startswith("#")]]


def suggestions(spec: RunSpec, est: Estimate, name: str) -> list[Suggestion]:
    """Checked settings for figure ``name``: each builds and makes the figure fit or smaller.

    Of a series (a smaller token budget, vLLM share or more devices) only the first that fits is
    kept, or the last one tried when none does.
    """
    out: list[Suggestion] = []
    slot: dict[str, int] = {}
    done: set[str] = set()
    for cand in _candidates(spec, est, name):
        tag = next((o for o in cand if o.startswith("#")), "")
        if tag in done:
            continue
        s = _check(spec, name, [o for o in cand if not o.startswith("#")])
        if s is None:
            continue
        if not tag:
            out.append(s)
            continue
        if tag in slot:  # a later member of the series replaces the earlier one
            out[slot[tag]] = s
        else:
            slot[tag] = len(out)
            out.append(s)
        if s.fits:
            done.add(tag)
    return out


def merge_overrides(a: Sequence[str], b: Sequence[str]) -> tuple[str, ...]:
    """``a`` and then ``b`` as one list of overrides: a key of ``b`` replaces the same key of ``a``
    (moved last), a hardware option (``hardware=<option>``) every hardware key of ``a``."""
    merged = dict(o.split("=", 1) for o in a)
    for ov in b:
        key, value = ov.split("=", 1)
        if key == "hardware":
            merged = {k: v for k, v in merged.items() if not k.startswith("hardware")}
        merged.pop(key, None)
        merged[key] = value
    return tuple(f"{k}={v}" for k, v in merged.items())


def setting_that_fits(spec: RunSpec, rounds: int = 6) -> Optional[tuple[tuple[str, ...], RunSpec]]:
    """``(overrides, the spec built with them)`` that make every figure fit, picked from
    ``suggestions`` one failing figure at a time (first one that makes the whole plan fit, else
    that figure, else the most saving); None when none is found."""
    applied: tuple[str, ...] = ()
    cur = spec
    for _ in range(rounds):
        est = estimate(cur)
        failing = list(over_limit(cur, est))
        if not failing:
            return applied, cur
        options = suggestions(cur, est, failing[0])
        if not options:
            return None
        pick = (next((s for s in options if fits(s.spec)), None) or next((s for s in options if s.fits), None)
                or min(options, key=lambda s: s.total))
        applied = merge_overrides(applied, pick.overrides)
        cur = pick.spec
    return None
