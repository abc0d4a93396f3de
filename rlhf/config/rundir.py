"""Run directory names: ``outputs/<date>/<time>``, made unique (``-1``, ``-2``, ...), claimed, and given
back when the run is refused before it starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional


def run_dir_for(cfg: Any, claim: bool = False) -> str:
    """A fresh run directory from hydra.run.dir (outputs/<date>/<time>), made unique. ``claim``:
    create it, so that two runs started in the same second get two directories, not one."""
    return unique_dir(run_dir_name(cfg), claim)


def run_dir_name(cfg: Any) -> str:
    """hydra.run.dir (default outputs/<date>/<time>), before it is made unique."""
    from omegaconf import OmegaConf

    pattern = OmegaConf.select(cfg, "hydra.run.dir", default=None)
    return str(pattern) if pattern else stamped("outputs")


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


@dataclass(frozen=True)
class Claimed:
    """A run dir this process created (absolute), and the nearest of its parents that existed before
    (``release`` removes nothing at or above it)."""

    path: str
    existed: str


def existing_parent(path: str) -> str:
    """The nearest of ``path``'s parents (or itself) that exists, absolute."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def release(claimed: Optional[Claimed]) -> None:
    """Give a claimed run dir back: it and the parents the claim created go, each only while empty."""
    if claimed is None:
        return
    path = claimed.path
    while path != claimed.existed and path.startswith(claimed.existed + os.sep):
        try:
            os.rmdir(path)
        except FileNotFoundError:  # removed already (a run refused in its preflight empties and removes its own)
            pass
        except OSError:  # not empty (the run wrote to it, or another run's dir is beside it): kept
            return
        path = os.path.dirname(path)
