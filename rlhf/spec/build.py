"""Composed config → typed, validated, derived, frozen ``RunSpec``.

``build`` is called once, in the driver. Workers receive the frozen result and nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf.spec import schema as S
from rlhf.spec.errors import SpecError
from rlhf.spec.validate import validate

ROLES = ("actor", "critic", "reference", "reward", "rollout")


@dataclass
class BatchPlan(S.Frozen):
    """The batch math of one step, computed once (all counts are samples, not tokens)."""

    prompts_per_step: int
    group_size: int
    samples_per_step: int
    train_world_size: int  # data-parallel ranks of the actor
    mini_batch_size: int  # samples per optimizer step, all ranks together
    optimizer_steps_per_step: int  # per rollout batch, all epochs
    micro_batch_size: int  # samples per forward/backward on one rank
    grad_accum: int  # micro-batches per rank per optimizer step


@dataclass
class Layout(S.Frozen):
    """Which global device indices each role occupies; rollout engines are TP groups."""

    mode: str
    total_devices: int
    roles: dict[str, tuple[int, ...]]
    engines: tuple[tuple[int, ...], ...]

    @property
    def rollout_tp(self) -> int:
        return len(self.engines[0]) if self.engines else 1

    def world_size(self, role: str) -> int:
        return len(self.roles.get(role, ()))


@dataclass
class RunSpec(S.Frozen):
    algo: Any
    model: S.ModelSpec
    hardware: S.HardwareSpec
    placement: S.PlacementSpec
    rollout: S.RolloutSpec
    train: S.TrainSpec
    data: S.DataSpec
    reward: S.RewardSpec
    tracking: S.TrackingSpec
    checkpoint: S.CheckpointSpec
    ray: S.RaySpec
    mode: str
    output_dir: Optional[str]
    resume: Optional[str]
    roles: tuple[str, ...]  # the roles this run needs, in ROLES order
    batch: BatchPlan
    layout: Layout
    rollout_engine: str  # resolved: hf | vllm
    overrides: tuple[str, ...] = field(default_factory=tuple)  # what the user changed

    @property
    def device(self) -> str:
        return "cuda" if self.hardware.accelerator == "cuda" else "cpu"


# ----------------------------------------------------------------------------- typing


def typed_config(cfg: DictConfig) -> dict[str, Any]:
    """Merge ``cfg`` onto the schemas and return the dataclass sections (or raise SpecError)."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    kind = OmegaConf.select(cfg, "algo.kind", default=None)
    if kind is None:
        name = OmegaConf.select(cfg, "algo.name", default="")
        kind = name if name in ("dpo", "rm", "sft") else "rl"
    algo_cls = S.ALGO_SCHEMAS.get(kind)
    if algo_cls is None:
        raise SpecError([f"algo.kind={kind!r} is unknown. Choose one of: {', '.join(S.ALGO_SCHEMAS)}."])
    schema = OmegaConf.structured(S.RunConfig)
    schema.algo = OmegaConf.structured(algo_cls)
    try:
        merged = OmegaConf.merge(schema, cfg)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise SpecError([_omegaconf_message(e)]) from None
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).split("\n")[0]
    if "Missing mandatory value" in msg:
        return f"{key} is required but not set. Set it, e.g. `{key}=...`."
    if "Key" in msg and "not in" in msg:
        return f"{key} is not a config key. {msg}. Check the spelling, or `rlhf-run --help`."
    if "Value" in msg and ("could not be converted" in msg or "is not a valid" in msg or "Invalid" in msg):
        return f"{key}: {msg}"
    return f"{key}: {msg}" if key else msg


# ----------------------------------------------------------------------------- derivation


def needed_roles(algo: Any, reward: S.RewardSpec) -> tuple[str, ...]:
    roles = ["actor"]
    if algo.kind == "rl":
        if algo.estimator == "gae":
            roles.append("critic")
        if algo.kl.coef > 0:
            roles.append("reference")
        if reward.model_path:
            roles.append("reward")
        roles.append("rollout")
    elif algo.kind == "dpo" and not algo.reference_free:
        roles.append("reference")
    return tuple(r for r in ROLES if r in roles)


def plan_layout(sections: dict[str, Any], roles: tuple[str, ...]) -> Layout:
    """Assign devices to roles. Assumes validation of counts already passed."""
    hw: S.HardwareSpec = sections["hardware"]
    pl: S.PlacementSpec = sections["placement"]
    total = hw.nodes * hw.devices_per_node
    tp = pl.rollout.tensor_parallel
    if pl.mode == "hybrid":
        role_devices = {r: tuple(range(total)) for r in roles}
        rollout_devices = tuple(range(total)) if "rollout" in roles else ()
        n_engines = pl.rollout.engines or max(total // tp, 1)
    else:
        counts = disaggregated_counts(pl, roles, total)
        role_devices, start = {}, 0
        for r in roles:
            role_devices[r] = tuple(range(start, start + counts[r]))
            start += counts[r]
        rollout_devices = role_devices.get("rollout", ())
        n_engines = pl.rollout.engines or max(len(rollout_devices) // tp, 1)
    engines = tuple(tuple(rollout_devices[i * tp:(i + 1) * tp]) for i in range(n_engines)) if rollout_devices else ()
    return Layout(mode=pl.mode, total_devices=total, roles=role_devices, engines=engines)


def disaggregated_counts(pl: S.PlacementSpec, roles: tuple[str, ...], total: int) -> dict[str, int]:
    """Device counts per role; 0 in the config means automatic.

    Automatic: rollout engines get a quarter of the devices (at least one engine); the actor gets
    the largest power of two that leaves one device for each other automatic role; those share
    what is left.
    """
    counts = {r: (getattr(pl, r) if r != "rollout" else pl.rollout.engines * pl.rollout.tensor_parallel) for r in roles}
    if "rollout" in roles and counts["rollout"] == 0:
        tp = pl.rollout.tensor_parallel
        counts["rollout"] = max(tp, (total // 4) // tp * tp)
    auto = [r for r in roles if counts[r] == 0]
    if not auto:
        return counts
    left = total - sum(counts.values())
    others = [r for r in auto if r != "actor"]
    if "actor" in auto:
        room = max(left - len(others), 1)
        counts["actor"] = 1 << (room.bit_length() - 1)
        left -= counts["actor"]
    for i, r in enumerate(others):
        counts[r] = max(left // len(others) + (1 if i < left % len(others) else 0), 1)
    return counts


def plan_batch(algo: Any, train: S.TrainSpec, world: int) -> BatchPlan:
    group = getattr(algo, "group_size", 1)
    samples = train.prompts_per_step * group
    mini = getattr(algo, "mini_batch_size", None) or samples
    epochs = getattr(algo, "epochs", 1)
    per_rank_mini = mini // max(world, 1)
    micro = min(train.micro_batch_size, max(per_rank_mini, 1))
    return BatchPlan(
        prompts_per_step=train.prompts_per_step,
        group_size=group,
        samples_per_step=samples,
        train_world_size=world,
        mini_batch_size=mini,
        optimizer_steps_per_step=max(samples // max(mini, 1), 1) * epochs,
        micro_batch_size=micro,
        grad_accum=max(per_rank_mini // max(micro, 1), 1),
    )


# ----------------------------------------------------------------------------- build


def build(cfg: DictConfig, overrides: tuple[str, ...] = ()) -> RunSpec:
    """Type, validate (every problem at once), derive and freeze. Raises SpecError."""
    sections = typed_config(cfg)
    roles = needed_roles(sections["algo"], sections["reward"])
    problems = validate(sections, roles)
    if problems:
        raise SpecError(problems)
    layout = plan_layout(sections, roles)
    batch = plan_batch(sections["algo"], sections["train"], layout.world_size("actor"))
    engine = sections["rollout"].engine
    if engine == "auto":
        engine = "vllm" if sections["hardware"].accelerator == "cuda" else "hf"
    spec = RunSpec(
        **sections,
        roles=roles,
        batch=batch,
        layout=layout,
        rollout_engine=engine,
        overrides=tuple(overrides),
    )
    return freeze(spec)


def freeze(obj: Any) -> Any:
    """Freeze a spec tree in place: dataclasses refuse writes, lists become tuples."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, freeze(getattr(obj, f.name)))
        object.__setattr__(obj, "_frozen", True)
        return obj
    if isinstance(obj, list):
        return tuple(freeze(x) for x in obj)
    if isinstance(obj, dict):
        return {k: freeze(v) for k, v in obj.items()}
    return obj


def to_dict(spec: Any) -> Any:
    """Plain python containers (for YAML, MLflow params and the run directory)."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return {f.name: to_dict(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    if isinstance(spec, (list, tuple)):
        return [to_dict(x) for x in spec]
    if isinstance(spec, dict):
        return {str(k): to_dict(v) for k, v in spec.items()}
    return spec


CONFIG_SECTIONS = tuple(f.name for f in dataclasses.fields(S.RunConfig))


def config_dict(spec: RunSpec) -> dict[str, Any]:
    """The user-facing config of a spec (no derived fields): ``build`` of it gives the same spec."""
    return {k: to_dict(getattr(spec, k)) for k in CONFIG_SECTIONS}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
