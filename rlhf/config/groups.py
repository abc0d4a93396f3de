"""The config groups: their options, their defaults, and the schemas and recipes in Hydra's ConfigStore."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from rlhf.paths import conf_dir, recipes_dir

# The groups a user picks from, in the order of conf/config.yaml's defaults list, and `recipe`.
GROUPS = ("algo", "placement", "model", "hardware", "data", "reward", "tracking", "recipe")
# Groups selected by other choices, not by the user (model_defaults follows model).
INTERNAL_GROUPS = ("model_defaults",)


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
    """Schemas, recipes and the ``parallel`` launcher go into Hydra's ConfigStore (recipes: group
    `recipe`, package _global_).

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
    # -m hydra/launcher=parallel: jobs that fit side by side on the Ray cluster run at the same time
    cs.store(group="hydra/launcher", name="parallel", provider="rlhf",
             node={"_target_": "hydra_plugins.rlhf_launcher.parallel_launcher.ParallelLauncher"})
    _registered.add(key)


def group_choices(group: str) -> list[str]:
    """The options of one of Hydra's own groups (hydra/sweeper, hydra/launcher), plugins included."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # plugins register their configs when they are discovered
    try:
        names = ConfigStore.instance().list(group)
    except OSError:
        names = []
    import importlib.resources

    try:  # Hydra's shipped yaml options (hydra/job_logging: default, none, ...)
        folder = importlib.resources.files("hydra.conf").joinpath(group)
        names += [p.name for p in folder.iterdir()] if folder.is_dir() else []
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    return sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(".yaml")})
