"""Every algo × placement × model × hardware combination of conf/, built fast.

Hydra composes one config in about 0.3 s, too slow for the 648 combinations. The groups are
independent, though: algo/<x>.yaml sets only `algo`, placement/ only `placement`, hardware/ only
`hardware`, model/ only `model`, and model_defaults/<model>.yaml (selected by the model) sets
`train`, `rollout`, `model` and a few scalar `algo` keys. So a handful of real Hydra compositions
give every option's typed sections, and a combination is assembled from them: model_defaults'
scalar algo keys are applied to the algo section as Hydra would. The tests check that premise on
the files, and compare assembled combinations with full Hydra compositions.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from functools import lru_cache

from omegaconf import OmegaConf

from rlhf import cli
from rlhf.paths import conf_dir
from rlhf.spec.build import typed_config

AXES = ("algo", "placement", "model", "hardware")


def options(group: str) -> list[str]:
    return cli.group_options(group)


def model_defaults(model: str) -> dict:
    path = conf_dir() / "model_defaults" / f"{model}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


def sections_of(overrides: list[str]) -> dict:
    return typed_config(cli.compose(overrides))


@lru_cache(maxsize=1)
def option_sections() -> dict:
    """{group: {option: sections}} from a few real compositions ("rows")."""
    algos, places, models, hws = (options(g) for g in AXES)
    plain = [m for m in models if "algo" not in model_defaults(m)] or models
    out: dict = {g: {} for g in AXES}
    n = max(len(algos), len(places), len(models), len(hws))
    rows = []
    for i in range(n):
        rows.append({"algo": algos[i % len(algos)], "placement": places[i % len(places)],
                     "model": plain[i % len(plain)], "hardware": hws[i % len(hws)]})
    for m in models:  # every model once, whatever its defaults touch
        if m not in {r["model"] for r in rows}:
            rows.append({"algo": algos[0], "placement": places[0], "model": m, "hardware": hws[0]})
    for row in rows:
        secs = sections_of([f"{g}={row[g]}" for g in AXES])
        out["placement"].setdefault(row["placement"], secs)
        out["hardware"].setdefault(row["hardware"], secs)
        out["model"].setdefault(row["model"], secs)
        if row["model"] in plain:
            out["algo"].setdefault(row["algo"], secs)
    return out


def assemble(algo: str, placement: str, model: str, hardware: str) -> dict:
    """Typed sections of one combination, as Hydra would compose them (fresh objects)."""
    src = option_sections()
    base = src["model"][model]
    secs = {k: copy.deepcopy(v) for k, v in base.items()}  # model, train, rollout, data, ... from the model row
    secs["algo"] = copy.deepcopy(src["algo"][algo]["algo"])
    secs["placement"] = copy.deepcopy(src["placement"][placement]["placement"])
    secs["hardware"] = copy.deepcopy(src["hardware"][hardware]["hardware"])
    for key, value in (model_defaults(model).get("algo") or {}).items():
        setattr(secs["algo"], key, value)  # model_defaults is merged after the algo group
    return secs


# The issue's algorithms and models cross every placement and hardware (108 per hardware option); the
# algorithms and models added since cross them with two models / two algorithms (every option still
# builds on every placement and hardware, at a third of the full product's time).
ISSUE_ALGOS = ("dpo", "dr_grpo", "grpo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "rm", "sft")
ISSUE_MODELS = ("llama3-70b", "llama3-8b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "tiny")


def combinations():
    algos, placements, models, hardware = (options(g) for g in AXES)
    combos = list(itertools.product(ISSUE_ALGOS, placements, ISSUE_MODELS, hardware))
    combos += itertools.product([a for a in algos if a not in ISSUE_ALGOS], placements, ["tiny", "qwen2.5-7b"], hardware)
    combos += itertools.product(["grpo", "sft"], placements, [m for m in models if m not in ISSUE_MODELS], hardware)
    return combos


def as_dict(secs: dict) -> dict:
    return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in secs.items()}
