"""Run directory names: ``outputs/<date>/<time>``, made unique (``-1``, ``-2``, ...) and claimed."""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any


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
