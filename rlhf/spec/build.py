"""Composed config → typed, validated, derived, frozen ``RunSpec``.

``build`` is called once, in the driver. Workers receive the frozen result and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf.rollout import registry as engines
from rlhf.spec import schema as S
from rlhf.plan.auto import resolve
from rlhf.spec.errors import SpecError
from rlhf.placement.layout import plan_layout
from rlhf.spec.runspec import ROLES, BatchPlan, ResolvedModel, RunSpec  # noqa: F401  (also imported from here)
from rlhf.spec.shape import apply_checkpoint_shape, shape_source
from rlhf.spec.validate import estimator_info, validate

# ----------------------------------------------------------------------------- typing


def algo_schema(cfg: Any) -> type:
    """The dataclass of the config's algo section, picked by ``algo.kind`` (or a known name)."""
    kind = OmegaConf.select(cfg, "algo.kind", default=None) if isinstance(cfg, DictConfig) else (
        (cfg.get("algo") or {}).get("kind") if isinstance(cfg, dict) else None
    )
    if kind is None:
        name = OmegaConf.select(cfg, "algo.name", default="") if isinstance(cfg, DictConfig) else (
            (cfg.get("algo") or {}).get("name", "") if isinstance(cfg, dict) else ""
        )
        kind = name if name in ("dpo", "rm", "sft") else "rl"
    cls = S.ALGO_SCHEMAS.get(kind)
    typed = OmegaConf.get_type(cfg, "algo") if isinstance(cfg, DictConfig) and "algo" in cfg else None
    if cls is None or (typed in S.ALGO_SCHEMAS.values() and typed is not cls):
        raise SpecError([
            f"algo.kind={kind!r} cannot be set: the algorithm's group file fixes it "
            f"({', '.join(f'{c.__name__}: {k}' for k, c in S.ALGO_SCHEMAS.items())}). "
            "Choose the algorithm with algo=<name> instead."
        ])
    return cls


def typed_config(cfg: Any) -> dict[str, Any]:
    """A composed config (DictConfig or plain dict) → the dataclass sections (or raise SpecError).

    This is the one ``OmegaConf.to_object`` of a run. A config that Hydra composed is already typed
    by the schemas in the ConfigStore, so it converts directly; anything else (a saved run config,
    a dict built in a test) is merged onto the schemas first, which checks every key and type.
    """
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    algo_cls = algo_schema(cfg)
    try:
        obj = None
        if OmegaConf.get_type(cfg) is S.RunConfig and OmegaConf.get_type(cfg, "algo") is algo_cls:
            # section by section: no copy of the whole tree (Hydra's own node stays out)
            values = {}
            for f in dataclasses.fields(S.RunConfig):
                v = cfg[f.name]
                values[f.name] = OmegaConf.to_object(v) if OmegaConf.is_config(v) else v
            obj = S.RunConfig(**values)
        if not isinstance(obj, S.RunConfig) or not isinstance(obj.algo, algo_cls):
            plain = cfg.copy()
            OmegaConf.set_struct(plain, False)
            plain.pop("hydra", None)
            schema = OmegaConf.structured(S.RunConfig)
            schema.algo = OmegaConf.structured(algo_cls)
            obj = OmegaConf.to_object(OmegaConf.merge(schema, plain))
    except OmegaConfBaseException as e:
        raise SpecError([omegaconf_message(e)]) from None
    # Keys forced in with ++ are dropped by to_object without a word: name them instead.
    given = flatten({k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"})
    known = flatten(to_dict(obj))
    prefixes = {".".join(k.split(".")[:i]) for k in known for i in range(1, k.count(".") + 2)}
    extra = sorted({
        next(".".join(k.split(".")[:i]) for i in range(1, k.count(".") + 2)
             if ".".join(k.split(".")[:i]) not in prefixes)
        for k in given
        if k not in known and not any(k.startswith(p + ".") for p in known)
    })
    if extra:
        raise SpecError([unknown_key_message(k, _schema_at(obj, k.rsplit(".", 1)[0]) if "." in k else S.RunConfig)
                         for k in extra])
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _schema_at(obj: Any, path: str) -> Optional[type]:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return type(obj) if dataclasses.is_dataclass(obj) else None


def omegaconf_message(e: OmegaConfBaseException, value: Any = None) -> str:
    """One line for an OmegaConf error: the key path, the value, what was expected."""
    key = getattr(e, "full_key", None) or ""
    msg = str(e).split("\n")[0].strip()
    if "missing mandatory value" in msg.lower() or type(e).__name__ == "MissingMandatoryValue":
        return f"{key} is required but not set (???). Set it: {key}=VALUE."
    if "not in" in msg and "Key" in msg:
        obj = getattr(e, "object_type", None)
        return unknown_key_message(key, obj)
    expected = _expected_type(e)
    got = value if value is not None else _value_in(msg)
    if expected:
        return f"{key}={got}: expected {expected}, got {got!r}. Give {_example(expected)}."
    return f"{key}: {msg}" if key else msg


def unknown_key_message(key: str, schema: Optional[type] = None) -> str:
    """``key`` is not a field of ``schema``: say so, with the closest fields."""
    import difflib

    leaf = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    fields = [f.name for f in dataclasses.fields(schema)] if schema is not None and dataclasses.is_dataclass(schema) else []
    close = difflib.get_close_matches(leaf, fields, n=3, cutoff=0.6)
    where = f" of {parent} ({schema.__name__})" if parent and schema is not None else ""
    hint = f" Did you mean {' or '.join((parent + '.' if parent else '') + c for c in close)}?" if close else ""
    known = f" Known keys: {', '.join(fields)}." if fields and not close else ""
    return f"{key} is not a config key{where}.{hint}{known}"


def _expected_type(e: OmegaConfBaseException) -> str:
    ref = getattr(e, "ref_type", None)
    text = str(e)
    for name, word in (("Float", "a float"), ("Integer", "an integer"), ("Boolean", "a boolean (true/false)"),
                       ("String", "a string")):
        if f"to {name}" in text:
            return word
    for name, word in (("float", "a float"), ("int", "an integer"), ("bool", "a boolean (true/false)")):
        if f"is not a valid {name}" in text:
            return word
    if ref is not None:
        r = str(ref)
        for t, word in (("float", "a float"), ("int", "an integer"), ("bool", "a boolean (true/false)"), ("str", "a string")):
            if r in (t, f"Optional[{t}]", f"<class '{t}'>"):
                return word
        if dataclasses.is_dataclass(ref):
            return f"a {ref.__name__} section (a mapping of keys)"
        if "List" in r or "list" in r:
            return "a list, e.g. [a, b]"
    return ""


def _example(expected: str) -> str:
    return {
        "a float": "a number such as 1e-6 or 0.2",
        "an integer": "a whole number such as 8",
        "a boolean (true/false)": "true or false",
        "a string": "a quoted string",
    }.get(expected, expected)


def _value_in(msg: str) -> str:
    # OmegaConf: "Value 'abc' of type 'str' could not be converted to Float"
    if msg.startswith("Value '"):
        return msg[len("Value '"):].split("'", 1)[0]
    return "?"


# ----------------------------------------------------------------------------- derivation


def needed_roles(algo: S.AlgoSpec, reward: S.RewardSpec, lora_rank: int = 0) -> tuple[str, ...]:
    roles = ["actor"]
    if algo.kind == "rl":
        est = estimator_info(algo)
        if est is not None and est.needs_critic:
            roles.append("critic")
        if algo.kl.coef > 0 and lora_rank == 0:  # with LoRA the actor, adapters off, is the reference
            roles.append("reference")
        if algo.teacher.path:  # on-policy distillation (algo=opd)
            roles.append("teacher")
        if reward.model_path:
            roles.append("reward")
        roles.append("rollout")
    elif algo.kind == "dpo" and not algo.reference_free:
        roles.append("reference")
    return tuple(r for r in ROLES if r in roles)


def plan_batch(algo: S.AlgoSpec, train: S.TrainSpec, world: int) -> BatchPlan:
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


def build(cfg: Any, overrides: tuple[str, ...] = (), changes: tuple[str, ...] = ()) -> RunSpec:
    """Composed config → typed, validated (every problem at once), derived, frozen. Raises SpecError.

    ``cfg`` is what Hydra composed (a DictConfig), or a plain dict such as ``config_dict`` of an
    earlier spec: ``build(config_dict(spec))`` gives back the same spec.
    """
    return build_sections(typed_config(cfg), overrides=overrides, changes=changes)


def build_sections(sections: dict[str, Any], overrides: tuple[str, ...] = (), changes: tuple[str, ...] = ()) -> RunSpec:
    """The typed sections (``typed_config``'s result, consumed) → frozen RunSpec. Raises SpecError."""
    algo_cls = S.ALGO_SCHEMAS.get(getattr(sections["algo"], "kind", None))
    if algo_cls is None or not isinstance(sections["algo"], algo_cls):
        raise SpecError([
            f"algo.kind={getattr(sections['algo'], 'kind', None)!r} does not match the algo section "
            f"({type(sections['algo']).__name__}). Choose the algorithm with algo=<name>, not algo.kind."
        ])
    shape = apply_checkpoint_shape(sections["model"])  # the plan describes the model that will load
    roles = needed_roles(sections["algo"], sections["reward"], sections["model"].lora.rank)
    problems = validate(sections, roles, shape_from=shape_source(sections["model"], shape))
    if problems:
        raise SpecError(problems)
    layout = plan_layout(sections, roles)
    batch = plan_batch(sections["algo"], sections["train"], layout.world_size("actor"))
    engine = engines.resolve(sections["rollout"].engine, sections["hardware"].accelerator, sections["rollout"].plugins)
    spec = RunSpec(
        **sections,
        roles=roles,
        batch=batch,
        layout=layout,
        rollout_engine=engine,
        overrides=tuple(overrides),
        changes=tuple(changes),
    )
    spec.auto = shape + resolve(spec)
    return freeze(spec)


def with_models(spec: RunSpec, models: dict[str, ResolvedModel]) -> RunSpec:
    """The spec with the models the driver resolved, frozen again (workers read these dirs)."""
    return freeze(dataclasses.replace(spec, models=dict(models)))


class FrozenDict(dict):
    """A dict that refuses writes (the spec's mappings); pickles as itself for Ray."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the run spec is frozen: change the config instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (FrozenDict, (dict(self),))

    def __deepcopy__(self, memo: Any) -> "FrozenDict":
        import copy

        return FrozenDict({k: copy.deepcopy(v, memo) for k, v in self.items()})


def freeze(obj: Any) -> Any:
    """Freeze a spec tree in place: dataclasses refuse writes, lists become tuples, dicts FrozenDicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, freeze(getattr(obj, f.name)))
        object.__setattr__(obj, "_frozen", True)
        return obj
    if isinstance(obj, (list, tuple)):
        return tuple(freeze(x) for x in obj)
    if isinstance(obj, dict):
        return FrozenDict({k: freeze(v) for k, v in obj.items()})
    return obj


def to_dict(value: Any) -> Any:
    """A spec, or any part of it, as plain python containers (for YAML, MLflow params and the run directory)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_dict(x) for x in value]
    if isinstance(value, dict):
        return {str(k): to_dict(v) for k, v in value.items()}
    return value


CONFIG_SECTIONS = tuple(f.name for f in dataclasses.fields(S.RunConfig))


def config_dict(spec: RunSpec) -> dict[str, Any]:
    """The user-facing config of a spec (no derived fields, ``auto`` where the config said so):
    ``build`` of it gives the same spec."""
    out = {k: to_dict(getattr(spec, k)) for k in CONFIG_SECTIONS}
    for d in spec.auto:
        *path, leaf = d.key.split(".")
        node = out
        for part in path:
            node = node[part]
        node[leaf] = d.given
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
