"""Where the shipped config groups and recipes are, in a source checkout and after `pip install .`."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def _shipped(package: str, top_level: str) -> Path:
    # A source checkout (editable install, tests) has the folders at the repo's top level; a built
    # wheel carries them as the data packages rlhf._conf and rlhf._recipes (see pyproject.toml).
    here = Path(__file__).resolve().parent.parent / top_level
    if here.is_dir():
        return here
    return Path(str(resources.files(package)))


def conf_dir() -> Path:
    return _shipped("rlhf._conf", "conf")


def recipes_dir() -> Path:
    return _shipped("rlhf._recipes", "recipes")


def cache_dir() -> Path:
    """Generated models, tokenizers and data of the built-in task (RLHF_CACHE overrides)."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf"))
