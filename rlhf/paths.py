"""Where the shipped config groups and recipes are, in a source checkout and after `pip install .`.

A source checkout (an editable install, or the tests) has ``conf/`` and ``recipes/`` at the top of
the repository. A built wheel carries them inside the package as ``rlhf/_conf`` and
``rlhf/_recipes`` (setup.py maps the folders to those data packages).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _shipped(inside: str, top_level: str) -> Path:
    installed = PACKAGE_DIR / inside
    if installed.is_dir():
        return installed
    checkout = PACKAGE_DIR.parent / top_level
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"neither {installed} nor {checkout} exists: rlhf is installed without its {top_level}/ folder "
        "(reinstall with `pip install .` from the repository)"
    )


def conf_dir() -> Path:
    """The config groups (config.yaml, algo/, placement/, model/, hardware/, ...)."""
    return _shipped("_conf", "conf")


def recipes_dir() -> Path:
    """Checked-in experiments, each a `# @package _global_` YAML selected with recipe=<name>."""
    try:
        return _shipped("_recipes", "recipes")
    except FileNotFoundError:
        return PACKAGE_DIR / "_recipes"  # no recipes: an empty group


def cache_dir() -> Path:
    """Generated models, tokenizers and data of the built-in task (RLHF_CACHE overrides)."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf"))


TRACKING_DIR_ENV = "RLHF_TRACKING_DIR"


def record_tracking_dir() -> None:
    """``rlhf-run``, before anything changes the working directory: the project's MLflow store is
    under ``outputs/`` of the directory it was started in (an existing $RLHF_TRACKING_DIR is kept)."""
    os.environ.setdefault(TRACKING_DIR_ENV, os.path.abspath("outputs"))


def tracking_dir() -> Path:
    """The folder of the default MLflow store (``mlflow.db``, ``mlartifacts/``): $RLHF_TRACKING_DIR,
    else ``outputs/`` of the working directory (a run started from Python, not ``rlhf-run``)."""
    return Path(os.environ.get(TRACKING_DIR_ENV) or os.path.abspath("outputs")).expanduser().resolve()
