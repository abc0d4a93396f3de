"""Composition through Hydra's compose API, and every Hydra/OmegaConf error turned into one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from rlhf.config.groups import group_choices, group_options, register_configs, yaml_error_line
from rlhf.config.overrides import check_group_choices, parse_overrides, user_dirs
from rlhf.paths import conf_dir


def compose(overrides: Sequence[str], config_dir: Optional[str] = None, config_name: str = "config"):
    """Compose the config (with Hydra's own node) or raise SpecError with one clear line."""
    from rlhf.spec.errors import SpecError

    overrides = list(overrides)
    parsed = check_group_choices(overrides) if config_dir is None else parse_overrides(overrides)
    folder = Path(config_dir or conf_dir()).expanduser().resolve()
    if not (folder / f"{config_name}.yaml").is_file():
        raise SpecError([
            f"no config {config_name}.yaml in {folder}. Give the run dir that holds the saved config "
            "(-cp outputs/<date>/<time> -cn config), or leave -cp out to start from the shipped groups."
        ])
    register_configs()
    if config_dir is None:  # the shipped groups: a first stage composed before is reused (memo.py)
        from rlhf.config.memo import compose_kept

        return compose_kept(parsed, folder, config_name, lambda ovs: _compose_whole(ovs, folder, config_name))
    return _compose_whole(overrides, folder, config_name)


def _compose_whole(overrides: list[str], folder: Path, config_name: str):
    """Hydra's compose of the config, with its own node; its errors as SpecError with one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf.spec.errors import SpecError

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra's own errors: unknown key, wrong type, bad override, missing config
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SpecError([hydra_message(e, overrides, str(folder), config_name)]) from None
    finally:
        GlobalHydra.instance().clear()


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        out.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return out


def hydra_message(e: Exception, overrides: Sequence[str], config_dir: str, config_name: str) -> str:
    """One line for a Hydra composition error: the key or option, the value, and a fix."""
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    from rlhf.spec.build import omegaconf_message, unknown_key_message

    chain = _chain(e)
    text = str(e).strip()
    first = text.split("\n")[0]

    import yaml

    for x in chain:  # a group file, recipe or primary config that is not valid YAML
        if isinstance(x, yaml.MarkedYAMLError):
            return yaml_error_line(x)
    if "Could not find '" in first:  # an unknown option of a group (checked earlier for our groups)
        missing = first.split("Could not find '", 1)[1].split("'", 1)[0]
        group, _, option = missing.rpartition("/")
        if group.startswith("hydra/"):  # a sweeper or launcher plugin: its own package
            return (f"{group} {option!r} not found. Choose one of: {', '.join(group_choices(group)) or '(none)'} "
                    f"(a plugin of another name: pip install hydra-{option.split('_')[0]}-{group.split('/')[-1]}).")
        if group:
            options = group_options(group, user_dirs(overrides))
            return f"{group} {option!r} not found. Choose one of: {', '.join(options) or '(none)'}."
        return first
    if "Could not append to config. An item is already at" in first:
        key = first.split("'")[1]
        return f"{key} already exists: set it with {key}=VALUE (a leading + only adds keys that do not exist)."
    if "Could not delete from config" in first:
        key = first.split("'")[1]
        return f"cannot delete {key}: there is no such key. Check the spelling (rlhf-run --help)."
    if "No match in the defaults list" in first:
        key = first.split("'")[1]
        return (
            f"{key}: not a config group of {config_name}.yaml in {config_dir}. A saved run config has no groups: "
            f"set keys ({key}.KEY=VALUE), or start from the shipped groups (leave -cp out)."
        )

    for x in chain:  # OmegaConf errors carry the key path
        if isinstance(x, ConfigKeyError) or (isinstance(x, OmegaConfBaseException) and "not in" in str(x) and "Key '" in str(x)):
            key = getattr(x, "full_key", None) or ""
            if key:
                return unknown_key_message(key, getattr(x, "object_type", None)) + (
                    " To add a new key anyway use ++KEY=VALUE." if key.startswith("hydra.") else ""
                )
        if isinstance(x, ValidationError) and getattr(x, "full_key", None):
            key = x.full_key
            value = _override_value(overrides, key)
            msg = str(x).split("\n")[0]
            if "is not a subclass of" in msg or "Invalid type assigned" in msg:
                if "." not in key:
                    return (
                        f"{key}={value}: {key} is a section, not a config group or a value. "
                        f"Set its keys, e.g. {key}.KEY=VALUE."
                    )
                return f"{key}={value}: {key} is a section of keys. Set its keys, e.g. {key}.KEY=VALUE."
            if "is not a ListConfig" in msg:
                return f"{key}={value}: expected a list. Write it in brackets, e.g. {key}=[{value}]."
            return omegaconf_message(x, value)

    # Setting a key under a section that is null (e.g. algo.critic.* when the algorithm has no critic)
    null = _null_parent(overrides, config_dir, config_name)
    if null:
        return null
    for x in chain:
        if isinstance(x, OmegaConfBaseException) and getattr(x, "full_key", None):
            return omegaconf_message(x)
    return " ".join(text.split("\n")[:2])


def _override_value(overrides: Sequence[str], key: str) -> str:
    for o in overrides:
        k, _, v = o.lstrip("+~").partition("=")
        if k == key:
            return v
    return "?"


def _null_parent(overrides: Sequence[str], config_dir: str, config_name: str) -> Optional[str]:
    """If a key override goes through a null section, say which and why (composes the rest again)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    parsed = parse_overrides(overrides)
    keep = [ov.input_line for ov in parsed if "." not in ov.key_or_group]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            base = hydra_compose(config_name=config_name, overrides=keep)
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()
    for ov in parsed:
        parts = ov.key_or_group.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            node = OmegaConf.select(base, prefix, default="<absent>")
            if node is None and (i < len(parts) or isinstance(ov.value(), dict)):
                if prefix == "algo.critic":
                    name = OmegaConf.select(base, "algo.name", default="?")
                    est = OmegaConf.select(base, "algo.estimator", default="?")
                    return (
                        f"{ov.input_line}: algo={name} has no critic (algo.critic is null): its estimator "
                        f"{est} uses no value model; only gae does. Use algo=ppo to train a critic, or drop "
                        "the critic setting."
                    )
                return (
                    f"{ov.input_line}: {prefix} is null in this config, so it has no keys to set. "
                    f"Choose a config where {prefix} is set, or set {prefix} itself."
                )
            if node == "<absent>":
                break
    return None
