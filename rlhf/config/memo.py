"""Composed configs kept per process, keyed on what Hydra's defaults list depends on.

Hydra composes in two stages: the defaults list (the primary config, the groups picked, the search
path) loaded and merged into one config, then every ``KEY=VALUE`` override applied to it with
``OmegaConf.update(cfg, key, value, merge=True)``. The first stage is nearly all of a compose's CPU
(~0.25 CPU-s: ~22 YAML files read and merged into the typed schema; a kept one and its values
~0.03, BENCHMARKS.md §11.5), and within one process (the test suite, a sweep's preflight of its
jobs) it repeats with the same groups and other values. So its result is kept here, keyed on the
group choices and ``hydra.*`` settings in their order, and the values are applied to a copy as Hydra
applies them; the hydra node's fields that name the overrides are written as Hydra writes them.
What this would not reproduce exactly goes to Hydra whole: ``+KEY``, ``++KEY``, ``~KEY``, dicts and
sweeps (Hydra applies them in order among the values), a user's config folders, a saved run config
(``config_dir``, not composed here), and any override that fails here (Hydra then raises its own
error). The key holds the size and modification time of every YAML file of the config folder and the
shipped recipes, so an edited file is read again.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

MAX_ENTRIES = 32
_entries: "OrderedDict[tuple, Any]" = OrderedDict()
_lock = threading.Lock()


def compose_kept(parsed: Sequence[Any], folder: Path, config_name: str,
                 compose_whole: Callable[[list[str]], Any]) -> Any:
    """The composed config of the overrides ``parsed`` (Hydra's parse of them), through a kept first
    stage where that is exact, else ``compose_whole`` of their command-line text."""
    everything = [ov.input_line for ov in parsed]
    kinds = [_kind(ov, folder) for ov in parsed]
    # another search path (-cd, hydra.searchpath): files the key does not cover
    if "other" in kinds or any(ov.key_or_group == "hydra.searchpath" for ov in parsed):
        return compose_whole(everything)
    first = [ov.input_line for ov, kind in zip(parsed, kinds) if kind == "first stage"]
    key = (str(folder), config_name, tuple(first), _files_signature(folder))
    with _lock:
        base = _entries.get(key)
        if base is not None:
            _entries.move_to_end(key)
    if base is None:
        try:
            base = compose_whole(first)
        except Exception:  # noqa: BLE001 - the error as the whole command line gets it from Hydra
            return compose_whole(everything)
        with _lock:  # never handed out: every caller gets a copy
            _entries[key] = base
            while len(_entries) > MAX_ENTRIES:
                _entries.popitem(last=False)
    try:
        return _with_values(base, parsed, [ov for ov, kind in zip(parsed, kinds) if kind == "value"])
    except Exception:  # noqa: BLE001 - Hydra's own compose raises its own error (or composes it after all)
        return compose_whole(everything)


def _with_values(base: Any, parsed: list, values: list) -> Any:
    from omegaconf import OmegaConf, open_dict

    if OmegaConf.select(base, "hydra.job.env_copy"):
        raise ValueError("hydra.job.env_copy reads the environment at compose time")
    cfg = copy.deepcopy(base)
    for ov in values:
        OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True)
    # the hydra node as Hydra's compose leaves it: the task overrides in their order, the job's
    # override_dirname (sorted input lines, '=' as kv_sep, exclude_keys left out), the cwd of now
    task = [ov for ov in parsed if not ov.is_hydra_override()]
    job = cfg.hydra.job
    named = sorted(ov.input_line for ov in task if ov.key_or_group not in job.config.override_dirname.exclude_keys)
    with open_dict(cfg.hydra):
        cfg.hydra.overrides.task = [ov.input_line for ov in task]
        job.override_dirname = re.sub("=", job.config.override_dirname.kv_sep,
                                      job.config.override_dirname.item_sep.join(named))
        cfg.hydra.runtime.cwd = os.getcwd()
    return cfg


def _kind(ov: Any, folder: Path) -> str:
    """The kind of one override. "value": ``KEY=VALUE``, which Hydra applies to the composed config
    in order; "first stage": a group's choice (``GROUP=OPTION``, ``+GROUP=``, ``~GROUP``) or a
    ``hydra.*`` setting, which decide the defaults list and touch no key a value sets; "other": the
    rest (``+KEY``, ``++KEY``, ``~KEY``, a dict, a sweep), which Hydra also applies in order among
    the values."""
    if ov.is_sweep_override() or isinstance(ov.value(), dict):
        return "other"
    if ov.is_hydra_override() or (not ov.is_force_add() and _names_a_group(ov.key_or_group, folder)):
        return "first stage"
    if ov.is_delete() or ov.is_add() or ov.is_force_add() or ov.package is not None:
        return "other"
    return "value"


def _names_a_group(key: str, folder: Path) -> bool:
    """Hydra's ``group_exists`` for the sources a kept compose has: ours (``recipe`` is the recipes
    source's group), a folder of the config dir, a group in the ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from rlhf.config.groups import GROUPS, INTERNAL_GROUPS

    return (key in GROUPS + INTERNAL_GROUPS or isinstance(ConfigStore.instance().repo.get(key), dict)
            or (folder / key).is_dir())


def _files_signature(folder: Path) -> tuple:
    """Size and modification time of every YAML file of the config folder and the shipped recipes."""
    from rlhf.paths import recipes_dir

    out = []
    for top in (folder, recipes_dir()):
        for root, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".yaml", ".yml")):
                    st = os.stat(os.path.join(root, name))
                    out.append((root, name, st.st_size, st.st_mtime_ns))
    return tuple(out)

