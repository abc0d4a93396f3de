"""The composed config → the frozen RunSpec: what the run changes, its run dir, a resumed run's spec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf.config.composition import compose
from rlhf.config.groups import GROUPS, INTERNAL_GROUPS, default_choices, option_file, search_dirs
from rlhf.config.overrides import parse_overrides
from rlhf.config.rundir import Claimed, existing_parent, run_dir_for, run_dir_name, unique_dir
from rlhf.quoting import quote_value, resume_command
from rlhf.spec.runspec import RunSpec


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
        searchpath = OmegaConf.select(cfg, "hydra.searchpath", default=None) or []
        path = option_file("recipe", recipe, search_dirs(list(searchpath)))
        keys = []
        if path is not None:
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


def claim_run_dir(cfg: Any, config_dir: Optional[str] = None) -> Optional[Claimed]:
    """A run's default run dir, created now (two runs started in the same second get two) and set
    as cfg.output_dir; None when the config names one or plans. ``rundir.release`` gives it back."""
    from omegaconf import open_dict

    with open_dict(cfg):
        _drop_saved_output_dir(cfg, config_dir)
        if cfg.get("mode", "run") != "run" or cfg.get("output_dir"):
            return None
        name = run_dir_name(cfg)
        existed = existing_parent(name)
        try:
            path = os.path.abspath(unique_dir(name, claim=True))
        except OSError as e:
            from rlhf.preflight import not_writable
            from rlhf.spec.errors import SpecError

            raise SpecError([not_writable(f"the run dir {os.path.abspath(name)} (hydra.run.dir)", e)]) from None
        cfg.output_dir = path
    return Claimed(path, existed)


def _drop_saved_output_dir(cfg: Any, config_dir: Optional[str]) -> None:
    saved = cfg.get("output_dir")
    if saved and config_dir and Path(str(saved)).resolve() == Path(config_dir).resolve():
        # Rerunning a run's saved config: the same config, in a new run dir of its own.
        cfg.output_dir = None


def build_spec(cfg: Any, overrides: Sequence[str], plan: bool, config_dir: Optional[str] = None,
               choices: Optional[dict] = None) -> RunSpec:
    """The composed config → frozen RunSpec (raises SpecError). ``config_dir``: the -cp folder,
    if the primary config did not come from the shipped groups. A run's output_dir is made absolute
    (relative to the cwd); without one, it is named (``run_dir_for``; ``claim_run_dir`` creates it).
    A plan without one gets that name as ``planned_run_dir`` (not created), where it measures the disk."""
    import dataclasses

    from omegaconf import open_dict

    from rlhf.spec.build import build, freeze

    with open_dict(cfg):
        if plan:
            cfg.mode = "plan"
        _drop_saved_output_dir(cfg, config_dir)
        if cfg.get("mode", "run") == "run":
            # the job may run inside its run dir (hydra.job.chdir): its path must not depend on the cwd
            cfg.output_dir = os.path.abspath(os.path.expanduser(str(cfg.get("output_dir") or run_dir_for(cfg))))
    if config_dir is None:
        changes = changes_from_defaults(cfg, overrides, choices)
    else:  # a saved config: what differs is the whole file, then the overrides on it
        changes = (f"the config of {Path(config_dir)} (-cp)", *overrides)
    spec = build(cfg, overrides=tuple(overrides), changes=changes)
    if spec.mode == "plan" and not spec.output_dir:
        planned = os.path.abspath(os.path.expanduser(run_dir_for(cfg)))
        spec = freeze(dataclasses.replace(spec, planned_run_dir=planned))
    return spec


def resume_dir(overrides: Sequence[str]) -> Optional[str]:
    """The run dir of ``resume=DIR`` among the overrides, if any, read by Hydra's grammar (a dir
    with a comma is quoted: ``resume='runs/a,b'``; unquoted, the grammar reads a sweep of two)."""
    from rlhf.spec.errors import SpecError

    for o in overrides:
        if o.partition("=")[0] != "resume":
            continue
        (override,) = parse_overrides([o])
        if override.is_sweep_override():
            raise SpecError([f"{o}: resume= takes one run dir, and Hydra reads a comma as a list of values. "
                             f"Quote a dir with a comma: {resume_command(o.partition('=')[2])}"])
        value = override.value()
        if value not in ("", None):
            return str(value)
    return None


def resume_spec(run_dir: str, overrides: Sequence[str], plan: bool = False) -> RunSpec:
    """``rlhf-run resume=<run dir> [KEY=VALUE ...]``: the run's saved config.yaml (+ overrides), in
    the same run dir; the RL loop then loads the newest checkpoint and continues at the next step."""
    from omegaconf import open_dict

    from rlhf.spec.build import build
    from rlhf.spec.errors import SpecError

    folder = Path(run_dir).expanduser().resolve()
    if not (folder / "config.yaml").is_file():
        raise SpecError([f"resume={run_dir}: no config.yaml there. Give the run dir of the run to continue "
                         "(outputs/<date>/<time>, the one holding config.yaml and checkpoints/)."])
    cfg = compose(list(overrides) + resume_overrides(folder), config_dir=str(folder),
                  config_name="config")
    with open_dict(cfg):
        cfg.mode = "plan" if plan else "run"
    return build(cfg, overrides=tuple(overrides), changes=(f"resume={folder}", *overrides))


def resume_overrides(folder: Path) -> list[str]:
    """The overrides that put a resumed run back in its run dir (quoted: the dir may hold a comma)."""
    return [f"output_dir={quote_value(str(folder))}", f"resume={quote_value(str(folder))}"]
