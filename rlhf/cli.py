"""`rlhf-run`: compose the config groups, build the spec, then plan or run.

    rlhf-run                                   # GRPO on the built-in task, CPU
    rlhf-run algo=ppo model=llama3-8b hardware=8xh100 --plan
    rlhf-run -m algo.lr=1e-3,3e-3              # a sweep (Hydra multirun)

A single run is composed with Hydra's compose API so that every config error becomes one line and
exit code 2 before anything starts; a sweep goes through ``hydra.main`` (its launcher runs the
jobs one after another) and each job is built the same way.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from rlhf.paths import conf_dir, recipes_dir

EXIT_CONFIG = 2
GROUPS = ("algo", "placement", "model", "hardware", "data", "reward", "tracking", "recipe")


def group_options(group: str) -> list[str]:
    folder = recipes_dir() if group == "recipe" else conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def register_configs() -> None:
    """Schemas and recipes go into Hydra's ConfigStore (recipes: group `recipe`, package _global_)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from rlhf.spec.schema import register

    register()
    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


HELP = """\
rlhf-run — RLHF training from composable config groups.

usage: rlhf-run [GROUP=OPTION ...] [KEY=VALUE ...] [--plan] [-m]

  --plan        print the batch math, placement map and memory estimate, then exit (no Ray, no GPU)
  -m            multirun: sweep comma-separated values, e.g. -m algo.lr=1e-6,5e-7
  -cp DIR -cn NAME
                take the primary config from DIR/NAME.yaml, e.g. a run dir to rerun its config:
                rlhf-run -cp outputs/2026-11-29/12-00-00 -cn config
  HYDRA_FULL_ERROR=1   show tracebacks

config groups (default first):
{groups}

examples:
  rlhf-run                                           # GRPO on the built-in task, on CPU
  rlhf-run algo=grpo placement=hybrid model=llama3-8b hardware=8xh100 --plan
  rlhf-run algo=ppo algo.kl.coef=0.05 train.steps=200
  rlhf-run recipe=<name>                             # a checked-in experiment from recipes/
"""

DEFAULTS = {
    "algo": "grpo",
    "placement": "hybrid",
    "model": "tiny",
    "hardware": "cpu",
    "data": "builtin",
    "reward": "builtin",
    "tracking": "mlflow",
    "recipe": "(none)",
}


def render_help() -> str:
    lines = []
    for g in GROUPS:
        opts = group_options(g)
        default = DEFAULTS[g]
        ordered = ([default] if default in opts else []) + [o for o in opts if o != default]
        lines.append(f"  {g:<10} {', '.join(ordered) if ordered else '(none)'}")
    return HELP.format(groups="\n".join(lines))


def _split_args(argv: Sequence[str]) -> tuple[list[str], dict[str, str], bool, bool]:
    """(overrides, options, plan, multirun) from the command line."""
    overrides, opts, plan, multirun = [], {}, False, False
    it = iter(argv)
    for a in it:
        if a == "--plan":
            plan = True
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a in ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"):
            opts[a] = next(it, "")
        elif a.startswith("--config-path=") or a.startswith("--config-name="):
            k, v = a.split("=", 1)
            opts[k] = v
        else:
            overrides.append(a)
    return overrides, opts, plan, multirun


def compose(overrides: list[str], config_dir: Optional[str] = None, config_name: str = "config"):
    """Compose the config (with Hydra's own config node) or raise SpecError with one clear line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf.spec.errors import SpecError

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir or conf_dir()).resolve()), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra's own errors: unknown option, bad override syntax, missing config
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SpecError([hydra_message(e, overrides)]) from None


def hydra_message(e: Exception, overrides: list[str]) -> str:
    text = str(e).strip()
    first = text.split("\n")[0]
    if "Could not find" in first or "Could not load" in first:
        for g in GROUPS:
            if f"'{g}/" in first or f"'{g}'" in first:
                bad = first.split(f"{g}/")[-1].rstrip("'").split("'")[0]
                return f"{g} {bad!r} not found. Choose one of: {', '.join(group_options(g))}."
        return first
    if "Could not override" in first or "Key '" in text and "not in struct" in text:
        lines = [line for line in text.split("\n") if line.strip()]
        key = first.split("'")[1] if "'" in first else first
        return (
            f"{key} is not a config key ({lines[-1].strip() if len(lines) > 1 else first}). "
            "Check the spelling, or add it with +key=value if the schema allows it."
        )
    if "Error parsing override" in first or "mismatched input" in text or "no viable alternative" in text:
        bad = [o for o in overrides if o.split("=", 1)[0] in text or o in text]
        return f"cannot parse the override {bad[0] if bad else ''!r}: write KEY=VALUE or GROUP=OPTION ({first})."
    return text.replace("\n", " ")


def run_dir_for(cfg) -> str:
    if cfg.get("output_dir"):
        return str(cfg.output_dir)
    pattern = cfg.hydra.run.dir
    return str(pattern) if pattern else os.path.join("outputs", datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))


def build_spec(cfg, overrides: list[str], plan: bool):
    """The composed config → frozen RunSpec (raises SpecError)."""
    from omegaconf import OmegaConf, open_dict

    from rlhf.spec.build import build

    with open_dict(cfg):
        if plan:
            cfg.mode = "plan"
        if cfg.get("mode", "run") == "run" and not cfg.get("output_dir"):
            cfg.output_dir = run_dir_for(cfg)
    user = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    return build(user, overrides=tuple(o for o in overrides if o != "--plan"))


def execute(spec) -> int:
    """Plan or run a built spec; the return value is the process exit code."""
    if spec.mode == "plan":
        from rlhf.spec.plan import render_plan

        print(render_plan(spec))
        return 0
    from rlhf.run import run

    return run(spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(render_help())
        return 0
    overrides, opts, plan, multirun = _split_args(argv)
    if multirun:
        from rlhf.sweep import multirun_main

        return multirun_main(overrides, opts, plan)

    from rlhf.spec.errors import SpecError

    try:
        cfg = compose(
            overrides,
            config_dir=opts.get("-cp") or opts.get("--config-path") or opts.get("-cd") or opts.get("--config-dir"),
            config_name=opts.get("-cn") or opts.get("--config-name") or "config",
        )
        spec = build_spec(cfg, overrides, plan)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_CONFIG
    return execute(spec)


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
