"""`rlhf-run`: compose the config groups, build the spec, then plan or run.

    rlhf-run                                   # GRPO on the built-in task, CPU
    rlhf-run algo=ppo model=llama3-8b hardware=8xh100 --plan
    rlhf-run -m algo.lr=1e-3,3e-3              # a sweep (Hydra multirun, see rlhf/sweep.py)
    rlhf-run -cp outputs/2026-11-29/12-00-00 -cn config    # rerun a run's saved config
    rlhf-run resume=outputs/2026-11-29/12-00-00            # continue it from its newest checkpoint

    rlhf-run --cfg job algo=ppo                            # Hydra's flags: --cfg, --info, -sc, ...

rlhf-run is a Hydra app (rlhf/hydra_app.py). The config is first composed with Hydra's compose
API, so every config error becomes one readable line and exit code 2 before anything starts
(HYDRA_FULL_ERROR=1 shows the traceback instead); then ``hydra.main`` runs the job in its run dir.
The composed config is typed by the schemas in Hydra's ConfigStore; ``rlhf.spec.build`` turns it
into the frozen RunSpec once, here in the driver.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf.paths import conf_dir, recipes_dir

EXIT_CONFIG = 2
# The groups a user picks from, in the order of conf/config.yaml's defaults list, and `recipe`.
GROUPS = ("algo", "placement", "model", "hardware", "data", "reward", "tracking", "recipe")
# Groups selected by other choices, not by the user (model_defaults follows model).
INTERNAL_GROUPS = ("model_defaults",)


# ----------------------------------------------------------------------------- groups


def group_options(group: str) -> list[str]:
    """The options of a config group (recipes: recipes/*.yaml; schema nodes are not options)."""
    folder = recipes_dir() if group == "recipe" else conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


@lru_cache(maxsize=1)
def default_choices() -> dict[str, Optional[str]]:
    """Each group's default option, read from conf/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    out: dict[str, Optional[str]] = {g: None for g in GROUPS}
    for entry in OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            for k, v in entry.items():
                k = k.replace("optional ", "").replace("override ", "").strip()
                if k in out:
                    out[k] = v
    return out


_registered: set[str] = set()


def register_configs() -> None:
    """Schemas and recipes go into Hydra's ConfigStore (recipes: group `recipe`, package _global_).

    Recipes are stored from recipes/*.yaml (shipped inside the wheel as rlhf/_recipes), so they are
    found after a non-editable install too; a recipe may have its own defaults list, e.g.
    ``- override /algo: ppo``.
    """
    key = str(recipes_dir())
    if key in _registered:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from rlhf.spec.schema import register

    register()
    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered.add(key)


# ----------------------------------------------------------------------------- help


HELP = """\
rlhf-run — RLHF training from composable config groups.

usage: rlhf-run [GROUP=OPTION ...] [KEY=VALUE ...] [--plan] [-m] [-cp DIR -cn NAME] [HYDRA FLAGS]

  --plan         print what differs from the defaults, the batch math, the placement map and the
                 memory per GPU, then exit (no Ray, no GPU; about a second)
  -m, --multirun sweep comma-separated values, one job each: rlhf-run -m algo.lr=1e-6,5e-7
                 (or search with Hydra's Optuna sweeper: rlhf-run -m recipe=grpo_tiny_optuna)
  -cp DIR -cn NAME
                 take the primary config from DIR/NAME.yaml; a run dir reruns its saved config:
                 rlhf-run -cp outputs/2026-11-29/12-00-00 -cn config
  resume=DIR     continue the run in DIR from its newest checkpoint (its config.yaml + any
                 overrides); a run whose output_dir already holds a checkpoint continues by itself
  -h, --help     this text
  HYDRA_FULL_ERROR=1  show tracebacks instead of one-line errors

config groups (the default first):
{groups}

keys: any KEY=VALUE of the spec, e.g. algo.lr=1e-6 algo.kl.coef=0.05 train.steps=200
      placement.rollout.tensor_parallel=2 rollout.max_response_tokens=512 output_dir=runs/x
      (the keys and their meaning: rlhf/spec/schema.py; a group's own file: conf/<group>/<option>.yaml)

examples:
  rlhf-run                                           # GRPO on the built-in task, on CPU
  rlhf-run algo=grpo placement=hybrid model=llama3-8b hardware=8xh100 --plan
  rlhf-run algo=ppo algo.kl.coef=0.05 train.steps=200
  rlhf-run recipe=grpo_tiny                          # a checked-in experiment from recipes/
"""


def render_help() -> str:
    defaults = default_choices()
    lines = []
    for g in GROUPS:
        opts = group_options(g)
        default = defaults.get(g)
        ordered = ([default] if default in opts else []) + [o for o in opts if o != default]
        if g == "recipe":
            ordered = ["(none)"] + ordered
        lines.append(f"  {g:<10} {', '.join(ordered) if ordered else '(none)'}")
    from rlhf.hydra_app import HYDRA_HELP

    return HELP.format(groups="\n".join(lines)) + "\n" + HYDRA_HELP


# ----------------------------------------------------------------------------- arguments


@dataclass
class Args:
    overrides: list[str] = field(default_factory=list)
    plan: bool = False
    multirun: bool = False
    config_dir: Optional[str] = None
    config_name: str = "config"
    hydra_flags: list[str] = field(default_factory=list)  # Hydra's own (--cfg, --info, -sc, ...), passed on

    @property
    def hydra_only(self) -> bool:
        """Hydra prints something and exits (--cfg, --info, --shell-completion, --hydra-help, --version)."""
        return any(f in ("--cfg", "--info", "--shell-completion", "--hydra-help", "--version") for f in self.hydra_flags)


FLAGS_WITH_VALUE = {
    "-cp": "config_dir", "--config-path": "config_dir", "-cd": "config_dir", "--config-dir": "config_dir",
    "-cn": "config_name", "--config-name": "config_name",
}


def parse_args(argv: Sequence[str]) -> Args:
    """Flags and overrides from the command line (raises SpecError for an unknown flag)."""
    from rlhf.hydra_app import CFG_KINDS, HYDRA_BARE_FLAGS, HYDRA_VALUE_FLAGS, INFO_FLAGS, INFO_TOPICS
    from rlhf.spec.errors import SpecError

    args = Args()
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a == "--plan":
            args.plan = True
        elif a in ("-m", "--multirun"):
            args.multirun = True
        elif a in FLAGS_WITH_VALUE or a in HYDRA_VALUE_FLAGS:
            value = argv[i] if i < len(argv) else None
            i += 1
            if value is None:
                example = "job" if a in ("-c", "--cfg") else "algo" if a in ("-p", "--package") else (
                    "outputs/<run dir>" if "p" in a or "d" in a else "config")
                raise SpecError([f"{a} needs a value, e.g. {a} {example}."])
            if a in ("-c", "--cfg") and value not in CFG_KINDS:
                raise SpecError([f"{a} {value}: choose one of {', '.join(CFG_KINDS)} (job: the config a run uses)."])
            if a in FLAGS_WITH_VALUE:
                setattr(args, FLAGS_WITH_VALUE[a], value)
            else:
                args.hydra_flags += [HYDRA_VALUE_FLAGS[a], value]
        elif a.split("=", 1)[0] in FLAGS_WITH_VALUE and "=" in a:
            k, v = a.split("=", 1)
            setattr(args, FLAGS_WITH_VALUE[k], v)
        elif a in HYDRA_BARE_FLAGS:
            args.hydra_flags.append(HYDRA_BARE_FLAGS[a])
        elif a in INFO_FLAGS:
            args.hydra_flags.append("--info")
            if i < len(argv) and argv[i] in INFO_TOPICS:
                args.hydra_flags.append(argv[i])
                i += 1
        elif a.startswith("-") and not a.startswith("~"):
            raise SpecError([
                f"unknown option {a!r}. Options: --plan, -m/--multirun, -cp DIR, -cn NAME, --help; Hydra's "
                "--cfg job|hydra|all, --info, --shell-completion (rlhf-run --help); "
                "everything else is GROUP=OPTION or KEY=VALUE."
            ])
        else:
            args.overrides.append(a)
    return args


def parse_overrides(overrides: Sequence[str]) -> list[Any]:
    """Hydra's parse of the overrides (raises SpecError naming the one that does not parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlhf.spec.errors import SpecError

    parser = OverridesParser.create()
    out = []
    for o in overrides:
        try:
            out.extend(parser.parse_overrides([o]))
        except Exception as e:  # OverrideParseException
            detail = str(e).split("\n")[1] if "\n" in str(e) else str(e)
            raise SpecError([
                f"cannot parse the override {o!r} ({detail.strip()}). Write GROUP=OPTION or KEY=VALUE, "
                "e.g. algo=ppo or algo.lr=1e-6; quote values with spaces or special characters."
            ]) from None
    return out


def check_group_choices(overrides: Sequence[str], allow_sweep: bool = False) -> None:
    """An unknown option of a group is an error with the valid ones (recipe and model_defaults are
    optional groups, so Hydra itself would silently skip an unknown one)."""
    from rlhf.spec.errors import SpecError

    problems = []
    for ov in parse_overrides(overrides):
        group = ov.key_or_group
        if ov.is_sweep_override() and not allow_sweep:
            problems.append(f"{ov.input_line}: a sweep of values needs -m (multirun): rlhf-run -m {ov.input_line}")
            continue
        if ov.is_delete() or ov.package or group not in GROUPS + INTERNAL_GROUPS:
            continue
        if ov.is_sweep_override():
            values = [str(v) for v in ov.sweep_string_iterator()]
        else:
            values = [str(ov.value())] if ov.value() is not None else []
        options = group_options("model" if group in INTERNAL_GROUPS else group)
        for v in values:
            if v not in options:
                if group in INTERNAL_GROUPS:
                    problems.append(
                        f"{group}={v}: {group} follows model= (it is model_defaults/<model>.yaml); pick model= instead."
                    )
                else:
                    problems.append(f"{group} {v!r} not found. Choose one of: {', '.join(options) or '(none)'}.")
    if problems:
        raise SpecError(problems)


# ----------------------------------------------------------------------------- compose


def compose(overrides: Sequence[str], config_dir: Optional[str] = None, config_name: str = "config"):
    """Compose the config (with Hydra's own node) or raise SpecError with one clear line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf.spec.errors import SpecError

    overrides = list(overrides)
    if config_dir is None:
        check_group_choices(overrides)
    else:
        parse_overrides(overrides)
    folder = Path(config_dir or conf_dir()).expanduser().resolve()
    if not (folder / f"{config_name}.yaml").is_file():
        raise SpecError([
            f"no config {config_name}.yaml in {folder}. Give the run dir that holds the saved config "
            "(-cp outputs/<date>/<time> -cn config), or leave -cp out to start from the shipped groups."
        ])
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra's own errors: unknown key, wrong type, bad override, missing config
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SpecError([hydra_message(e, overrides, str(folder), config_name)]) from None
    finally:
        GlobalHydra.instance().clear()


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        out.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return out


def hydra_message(e: Exception, overrides: Sequence[str], config_dir: str, config_name: str) -> str:
    """One line for a Hydra composition error: the key or option, the value, and a fix."""
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    from rlhf.spec.build import omegaconf_message, unknown_key_message

    chain = _chain(e)
    text = str(e).strip()
    first = text.split("\n")[0]

    if "Could not find '" in first:  # an unknown option of a group (checked earlier for our groups)
        missing = first.split("Could not find '", 1)[1].split("'", 1)[0]
        group, _, option = missing.rpartition("/")
        if group.startswith("hydra/"):  # a sweeper or launcher plugin: its own package
            from rlhf.hydra_app import group_choices

            return (f"{group} {option!r} not found. Choose one of: {', '.join(group_choices(group)) or '(none)'} "
                    f"(a plugin of another name: pip install hydra-{option.split('_')[0]}-{group.split('/')[-1]}).")
        if group:
            return f"{group} {option!r} not found. Choose one of: {', '.join(group_options(group)) or '(none)'}."
        return first
    if "Could not append to config. An item is already at" in first:
        key = first.split("'")[1]
        return f"{key} already exists: set it with {key}=VALUE (a leading + only adds keys that do not exist)."
    if "Could not delete from config" in first:
        key = first.split("'")[1]
        return f"cannot delete {key}: there is no such key. Check the spelling (rlhf-run --help)."
    if "No match in the defaults list" in first:
        key = first.split("'")[1]
        return (
            f"{key}: not a config group of {config_name}.yaml in {config_dir}. A saved run config has no groups: "
            f"set keys ({key}.KEY=VALUE), or start from the shipped groups (leave -cp out)."
        )

    for x in chain:  # OmegaConf errors carry the key path
        if isinstance(x, ConfigKeyError) or (isinstance(x, OmegaConfBaseException) and "not in" in str(x) and "Key '" in str(x)):
            key = getattr(x, "full_key", None) or ""
            if key:
                return unknown_key_message(key, getattr(x, "object_type", None)) + (
                    " To add a new key anyway use ++KEY=VALUE." if key.startswith("hydra.") else ""
                )
        if isinstance(x, ValidationError) and getattr(x, "full_key", None):
            key = x.full_key
            value = _override_value(overrides, key)
            msg = str(x).split("\n")[0]
            if "is not a subclass of" in msg or "Invalid type assigned" in msg:
                if "." not in key:
                    return (
                        f"{key}={value}: {key} is a section, not a config group or a value. "
                        f"Set its keys, e.g. {key}.KEY=VALUE."
                    )
                return f"{key}={value}: {key} is a section of keys. Set its keys, e.g. {key}.KEY=VALUE."
            if "is not a ListConfig" in msg:
                return f"{key}={value}: expected a list. Write it in brackets, e.g. {key}=[{value}]."
            return omegaconf_message(x, value)

    # Setting a key under a section that is null (e.g. algo.critic.* when the algorithm has no critic)
    null = _null_parent(overrides, config_dir, config_name)
    if null:
        return null
    for x in chain:
        if isinstance(x, OmegaConfBaseException) and getattr(x, "full_key", None):
            return omegaconf_message(x)
    return " ".join(text.split("\n")[:2])


def _override_value(overrides: Sequence[str], key: str) -> str:
    for o in overrides:
        k, _, v = o.lstrip("+~").partition("=")
        if k == key:
            return v
    return "?"


def _null_parent(overrides: Sequence[str], config_dir: str, config_name: str) -> Optional[str]:
    """If a key override goes through a null section, say which and why (composes the rest again)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    parsed = parse_overrides(overrides)
    keep = [ov.input_line for ov in parsed if "." not in ov.key_or_group]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            base = hydra_compose(config_name=config_name, overrides=keep)
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()
    for ov in parsed:
        parts = ov.key_or_group.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            node = OmegaConf.select(base, prefix, default="<absent>")
            if node is None and (i < len(parts) or isinstance(ov.value(), dict)):
                if prefix == "algo.critic":
                    name = OmegaConf.select(base, "algo.name", default="?")
                    est = OmegaConf.select(base, "algo.estimator", default="?")
                    return (
                        f"{ov.input_line}: algo={name} has no critic (algo.critic is null): its estimator "
                        f"{est} uses no value model; only gae does. Use algo=ppo to train a critic, or drop "
                        "the critic setting."
                    )
                return (
                    f"{ov.input_line}: {prefix} is null in this config, so it has no keys to set. "
                    f"Choose a config where {prefix} is set, or set {prefix} itself."
                )
            if node == "<absent>":
                break
    return None


# ----------------------------------------------------------------------------- spec


def changes_from_defaults(cfg: Any, overrides: Sequence[str], choices: Optional[dict] = None) -> tuple[str, ...]:
    """What this run changes: group choices other than the default, a recipe's keys, and every key
    set on the command line with its resulting value. ``choices``: Hydra's group choices (default:
    the composed config's hydra.runtime.choices)."""
    from omegaconf import OmegaConf

    out = []
    if choices is None:
        choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}
    defaults = default_choices()
    for g in GROUPS:
        choice = choices.get(g)
        if g == "recipe" or choice is None or choice == defaults.get(g):
            continue
        out.append(f"{g}={choice} (default {defaults.get(g)})")
    recipe = choices.get("recipe")
    if recipe:
        path = recipes_dir() / f"{recipe}.yaml"
        keys = []
        if path.is_file():
            node = OmegaConf.to_container(OmegaConf.load(path))
            node.pop("defaults", None)
            from rlhf.spec.build import flatten

            keys = [f"{k}={v}" for k, v in flatten(node).items()]
        out.append(f"recipe={recipe}" + (f": {' '.join(keys)}" if keys else ""))
    try:
        parsed = parse_overrides(overrides)
    except Exception:
        parsed = []
    for ov in parsed:
        key = ov.key_or_group
        if key in GROUPS + INTERNAL_GROUPS or key.startswith("hydra.") or key == "hydra":
            continue
        if ov.is_delete():
            out.append(f"~{key} (removed)")
            continue
        value = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        out.append(f"{key}={value}")
    return tuple(out)


def run_dir_for(cfg: Any, claim: bool = False) -> str:
    """A fresh run directory from hydra.run.dir (outputs/<date>/<time>), made unique. ``claim``:
    create it, so that two runs started in the same second get two directories, not one."""
    from omegaconf import OmegaConf

    pattern = OmegaConf.select(cfg, "hydra.run.dir", default=None)
    return unique_dir(str(pattern) if pattern else stamped("outputs"), claim)


def stamped(root: str) -> str:
    """``<root>/<date>/<time>``, Hydra's default run (outputs) and sweep (multirun) dir."""
    return os.path.join(root, datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))


def unique_dir(base: str, claim: bool = False) -> str:
    """``base``, else ``base-1``, ``base-2``...: the first that does not exist (``claim``: created)."""
    path, i = base, 1
    while True:
        try:
            if claim:
                os.makedirs(path)  # exclusive for its last part: exactly one process creates it
            elif os.path.exists(path):
                raise FileExistsError(path)
            return path
        except FileExistsError:
            path, i = f"{base}-{i}", i + 1


def build_spec(cfg: Any, overrides: Sequence[str], plan: bool, config_dir: Optional[str] = None,
               choices: Optional[dict] = None, claim_run_dir: bool = False):
    """The composed config → frozen RunSpec (raises SpecError). ``config_dir``: the -cp folder,
    if the primary config did not come from the shipped groups. ``claim_run_dir``: create the
    default run dir now (``run_dir_for``); it is removed again if the spec does not build."""
    from omegaconf import open_dict

    from rlhf.spec.build import build

    claimed = None
    with open_dict(cfg):
        if plan:
            cfg.mode = "plan"
        saved = cfg.get("output_dir")
        if saved and config_dir and Path(str(saved)).resolve() == Path(config_dir).resolve():
            # Rerunning a run's saved config: the same config, in a new run dir of its own.
            cfg.output_dir = None
        if cfg.get("mode", "run") == "run" and not cfg.get("output_dir"):
            cfg.output_dir = claimed = run_dir_for(cfg, claim=claim_run_dir and not plan)
    try:
        if config_dir is None:
            changes = changes_from_defaults(cfg, overrides, choices)
        else:  # a saved config: what differs is the whole file, then the overrides on it
            changes = (f"the config of {Path(config_dir)} (-cp)", *overrides)
        return build(cfg, overrides=tuple(overrides), changes=changes)
    except BaseException:
        if claimed and claim_run_dir:
            with contextlib.suppress(OSError):  # only while empty, with its empty parents (outputs/<date>)
                os.removedirs(claimed)
        raise


# ----------------------------------------------------------------------------- run


def _resume_dir(overrides: Sequence[str]) -> Optional[str]:
    for o in overrides:
        k, _, v = o.partition("=")
        if k == "resume" and v not in ("", "null"):
            return v
    return None


def resume_spec(run_dir: str, overrides: Sequence[str], plan: bool = False):
    """``rlhf-run resume=<run dir> [KEY=VALUE ...]``: the run's saved config.yaml (+ overrides), in
    the same run dir; the RL loop then loads the newest checkpoint and continues at the next step."""
    from omegaconf import open_dict

    from rlhf.spec.build import build
    from rlhf.spec.errors import SpecError

    folder = Path(run_dir).expanduser().resolve()
    if not (folder / "config.yaml").is_file():
        raise SpecError([f"resume={run_dir}: no config.yaml there. Give the run dir of the run to continue "
                         "(outputs/<date>/<time>, the one holding config.yaml and checkpoints/)."])
    cfg = compose(list(overrides) + [f"output_dir={folder}", f"resume={folder}"], config_dir=str(folder),
                  config_name="config")
    with open_dict(cfg):
        cfg.mode = "plan" if plan else "run"
    return build(cfg, overrides=tuple(overrides), changes=(f"resume={folder}", *overrides))


def check_before_run(spec: Any) -> int:
    """The checks a run passes before anything (its run dir included) is made: 0, or exit code 2
    having printed why (a GPU plan that does not fit, an output dir that cannot be written)."""
    from rlhf.spec.errors import UserError

    try:
        if spec.hardware.accelerator == "cuda":
            from rlhf.preflight import check_fits

            check_fits(spec)
        from rlhf.preflight import check_output_dir

        check_output_dir(spec.output_dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_CONFIG)
    return 0


def execute(spec: Any, checked: bool = False) -> int:
    """Plan or run a built spec; the return value is the process exit code. ``checked``:
    ``check_before_run`` has passed already.

    The sweep (rlhf/sweep.py) calls this for every job too.
    """
    if spec.mode == "plan":
        from rlhf.spec.plan import render_plan

        print(render_plan(spec), flush=True)
        return 0
    from rlhf.spec.errors import UserError

    if not checked:
        code = check_before_run(spec)
        if code:
            return code
    if spec.hardware.accelerator == "cuda":
        from rlhf.spec.memory import estimate
        from rlhf.spec.plan import warnings

        for w in warnings(spec, estimate(spec)):  # the ones that do not stop the run (idle GPUs, ...)
            print(f"warning: {w}", file=sys.stderr)
    from rlhf.run import run

    try:
        return int(run(spec) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_CONFIG)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``rlhf-run``: the exit code (0 ok, 2 a config or input error, 1 a failed run or sweep job)."""
    from rlhf.spec.errors import SpecError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(render_help())
        return 0
    try:
        args = parse_args(argv)
        if args.hydra_only:
            return hydra_only(args)
        if args.multirun:
            from rlhf.sweep import multirun_main

            return multirun_main(args)
        resume = _resume_dir(args.overrides)
        if resume is not None:
            overrides = [o for o in args.overrides if o.split("=", 1)[0] != "resume"]
            spec = resume_spec(resume, overrides, args.plan)
            if spec.mode == "plan":
                return execute(spec)
            folder = str(Path(resume).expanduser().resolve())
            return run_in_hydra(spec, [*overrides, f"output_dir={folder}", f"resume={folder}"], config_dir=folder)
        cfg = compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
        if not args.plan and _chdir(cfg) and not cfg.get("output_dir"):
            # the job runs inside its run dir (hydra.job.chdir): its path must not depend on the cwd
            from omegaconf import open_dict

            with open_dict(cfg):
                cfg.output_dir = os.path.abspath(run_dir_for(cfg, claim=True))
        spec = build_spec(cfg, args.overrides, args.plan, config_dir=args.config_dir, claim_run_dir=True)
    except SpecError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(e.render(), file=sys.stderr)
        return EXIT_CONFIG
    if spec.mode == "plan":
        return execute(spec)
    return run_in_hydra(spec, args.overrides, config_dir=args.config_dir, config_name=args.config_name)


def _chdir(cfg: Any) -> bool:
    from omegaconf import OmegaConf

    return bool(OmegaConf.select(cfg, "hydra.job.chdir", default=False))


def hydra_only(args: Args) -> int:
    """--cfg, --info, --shell-completion, --hydra-help, --version: Hydra prints, nothing runs. The
    config is composed first, so that a config error is still one line and exit code 2."""
    from rlhf.hydra_app import hydra_overrides, run_app

    composes = any(f in ("--cfg", "--info") for f in args.hydra_flags)
    if composes and not args.multirun:
        compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
    argv = [*args.hydra_flags, *(["--multirun"] if args.multirun else []),
            *hydra_overrides(args.config_dir), *args.overrides]
    return run_app(lambda cfg: None, argv, config_dir=args.config_dir, config_name=args.config_name)


def run_in_hydra(spec: Any, overrides: Sequence[str], config_dir: Optional[str] = None,
                 config_name: str = "config") -> int:
    """Run a built spec as the job of the Hydra app: Hydra makes its run dir the spec's output_dir
    (``.hydra/`` inside, ``hydra.job.chdir`` honoured), then the task executes the spec. The spec was
    built from the same config before Hydra started, so a config error never starts a job."""
    from rlhf.hydra_app import hydra_overrides, run_app

    code = check_before_run(spec)  # before Hydra makes the run dir
    if code:
        return code
    codes: list[int] = []
    raised: list[BaseException] = []

    def task(cfg: Any) -> None:
        try:
            codes.append(execute(spec, checked=True))
        except BaseException as e:  # noqa: BLE001 - raised again outside Hydra, which would print it as its own
            raised.append(e)

    argv = [*hydra_overrides(config_dir), *overrides, f"hydra.run.dir={_quote(str(spec.output_dir))}"]
    code = run_app(task, argv, config_dir=config_dir, config_name=config_name)
    if raised:
        raise raised[0]
    return codes[0] if codes else (code or 1)


def _quote(value: str) -> str:
    """An override value that Hydra's grammar reads back verbatim (paths with spaces, =, ...)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def entrypoint() -> None:
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # rlhf-run --plan | head
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    entrypoint()
