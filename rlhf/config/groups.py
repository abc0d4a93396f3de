"""The config groups: their options, their defaults, and the schemas and recipes in Hydra's ConfigStore."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf import paths
from rlhf.paths import conf_dir

# The groups a user picks from, in the order of conf/config.yaml's defaults list, and `recipe`.
GROUPS = ("algo", "placement", "model", "hardware", "data", "reward", "tracking", "recipe")
# Groups selected by other choices, not by the user (model_defaults follows model).
INTERNAL_GROUPS = ("model_defaults",)


# A default folder of the user's own config groups and recipes, searched like -cd (os.pathsep between several).
USER_DIRS_ENV = "RLHF_CONFIG_DIRS"
# The search path entry of the shipped recipes (conf/config.yaml's hydra.searchpath), always the last.
RECIPES_SOURCE = "rlhf://recipes"


def search_dirs(searchpath: Sequence[str]) -> list[Path]:
    """The folders of Hydra search path entries (``file://DIR``, ``pkg://package``), in order; an
    entry that names no folder here is left out (Hydra warns about it itself)."""
    out = []
    for entry in searchpath:
        scheme, sep, rest = str(entry).partition("://")
        if not sep:
            scheme, rest = "file", str(entry)
        if scheme == "file":
            out.append(Path(rest).expanduser().resolve())
        elif scheme == "pkg":
            import importlib.resources

            try:
                out.append(Path(str(importlib.resources.files(rest.replace("/", ".")))))
            except (ModuleNotFoundError, TypeError, ValueError):
                pass
    return out


def _folders(group: str, dirs: Sequence[Path]) -> list[Path]:
    """Where Hydra looks for ``group/<option>.yaml``, first match first: conf/ (Hydra's primary
    config dir), the user's folders (-cd, then hydra.searchpath), then, for recipes, the shipped
    recipes (``RECIPES_SOURCE``, last on the search path) — so a user's recipe of a shipped name
    replaces it, and a user's group option adds to the shipped ones (conf/ comes first)."""
    shipped = paths.recipes_dir() if group == "recipe" else None
    return [conf_dir() / group, *(Path(d) / group for d in dirs), *([shipped] if shipped else [])]


def group_options(group: str, dirs: Sequence[Path] = ()) -> list[str]:
    """The options of a config group (recipes: recipes/*.yaml; schema nodes are not options),
    with those of the user's folders ``dirs``; a broken file is still an option (see ``option_problem``)."""
    names = set()
    for folder in _folders(group, dirs):
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def option_file(group: str, option: str, dirs: Sequence[Path] = ()) -> Optional[Path]:
    """The file Hydra composes for ``group=option``: the first in its search order."""
    for folder in _folders(group, dirs):
        if (folder / f"{option}.yaml").is_file():
            return folder / f"{option}.yaml"
    return None


def yaml_problem(path: Path) -> Optional[str]:
    """One line for a YAML file that does not parse (file, line and column), None when it does."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    try:  # OmegaConf's own loader: what Hydra reads the file with (duplicate keys are errors too)
        yaml.load(path.read_text(), Loader=get_yaml_loader())
    except yaml.MarkedYAMLError as e:
        return yaml_error_line(e, path)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        return f"{path}: cannot be read as YAML ({' '.join(str(e).split())}). Fix the file."
    return None


def yaml_error_line(e: Exception, path: Any = None) -> str:
    """``<file>:<line>:<column>: <problem>`` for a YAML parse error (line and column counted from 1)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    name = path or (mark.name if mark is not None else "?")
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(name)
    problem = getattr(e, "problem", None) or str(e).split("\n")[0]
    context = getattr(e, "context", None)
    what = f"{context}, {problem}" if context else problem
    return f"{where}: not valid YAML ({' '.join(str(what).split())}). Fix the file there."


def option_problem(group: str, option: str, dirs: Sequence[Path] = ()) -> Optional[str]:
    """Why ``group=option`` cannot be used (its file is not valid YAML), or None."""
    path = option_file(group, option, dirs)
    problem = yaml_problem(path) if path is not None else None
    return f"{group}={option}: {problem}" if problem else None


def broken_options(group: str, dirs: Sequence[Path] = ()) -> list[str]:
    """The options of ``group`` whose file is not valid YAML (``rlhf-run --help`` marks them)."""
    return [o for o in group_options(group, dirs) if option_problem(group, o, dirs)]


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
    """Schemas and the ``parallel`` launcher go into Hydra's ConfigStore.

    The recipes are not stored there: Hydra reads one from the ``rlhf://recipes`` source
    (hydra_plugins/rlhf_recipes) only when it is picked, so a recipe that is not valid YAML fails
    alone (``option_problem`` names file, line and column first) and every other command works.
    """
    key = "rlhf"
    if key in _registered:
        return
    from hydra.core.config_store import ConfigStore

    from rlhf.spec.schema import register

    register()
    # Hydra finds plugins by walking the hydra_plugins namespace, which misses a package of an editable
    # install (its path hook lists nothing): the recipes' config source is registered by hand, through
    # Plugins.register, the public call for that.
    from hydra.core.plugins import Plugins
    from hydra_plugins.rlhf_recipes.recipes_source import RecipesConfigSource

    Plugins.instance().register(RecipesConfigSource)
    cs = ConfigStore.instance()
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
