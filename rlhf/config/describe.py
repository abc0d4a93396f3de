"""``rlhf-run --describe KEY``: a config key's type, its value in the composed config and its help text.

The help texts live beside the fields in ``rlhf.spec.schema`` (``metadata["help"]``); the value comes
from the composed config, so it honours the chosen groups and the other overrides on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import typing
from typing import Any, Iterator, Optional

from rlhf.spec import schema


def _field_class(annotation: Any) -> Optional[type]:
    """The schema dataclass behind a field's type (``X``, ``Optional[X]``), or None for a leaf."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _node_class(node: Any) -> Optional[type]:
    """The structured type of a composed section (how ``algo: Any`` gets RLAlgo, DPOAlgo, ...)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        kind = OmegaConf.get_type(node)
        return kind if dataclasses.is_dataclass(kind) else None
    return None


def _children(cls: type, node: Any) -> Iterator[tuple[dataclasses.Field, Optional[type], Any]]:
    """Each field of section ``cls``: the field, its section class (None for a leaf) and its node."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        child = _get(node, f.name)
        sub = _field_class(hints[f.name]) or (_node_class(child) if hints[f.name] is Any else None)
        yield f, sub, child


def _get(node: Any, name: str) -> Any:
    from omegaconf import DictConfig

    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing() and name in node:
        return node._get_node(name)
    return None


def all_keys(cfg: Any) -> list[str]:
    """Every key the schema documents for this composed config: sections and leaves, dotted."""
    out: list[str] = []

    def walk(cls: type, node: Any, prefix: str) -> None:
        for f, sub, child in _children(cls, node):
            key = prefix + f.name
            out.append(key)
            if sub is not None:
                walk(sub, child, key + ".")

    walk(schema.RunConfig, cfg, "")
    return out


def _value(node: Any) -> str:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if node is None:
        return "null"
    if isinstance(node, (DictConfig, ListConfig)):
        if node._is_missing():
            return "??? (required)"
        if node._is_none():
            return "null"
        return str(OmegaConf.to_container(node, resolve=False))
    if node._is_missing():
        return "??? (required)"
    value = node._value()
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def _type_name(f: dataclasses.Field, sub: Optional[type]) -> str:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if text == "Any" and sub is not None:
        return sub.__name__
    return text


def _default(f: dataclasses.Field) -> str:
    """The schema's default of a field whose section is unset (null) in this config."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return str(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
    value = f.default
    if value is dataclasses.MISSING or value == schema.MISSING:
        return "???"
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def _entry(key: str, f: dataclasses.Field, sub: Optional[type], node: Any, indent: str = "") -> list[str]:
    if node is None:  # inside a section that is null here
        default = _default(f)
        value = " (required once the section is set)" if default == "???" else (
            f" (default {default} once the section is set)")
    elif sub is not None and not node._is_none() and not node._is_missing():
        value = ""
    else:
        value = f" = {_value(node)}"
    text = textwrap.wrap(f.metadata.get("help", ""), width=100, initial_indent=indent + "    ",
                         subsequent_indent=indent + "    ")
    return [f"{indent}{key}: {_type_name(f, sub)}{value}", *text]


def describe(cfg: Any, key: str) -> str:
    """The text ``--describe KEY`` prints: the field (or, for a section, the section and every field
    under it) with type, value in ``cfg`` and help. Raises SpecError for a key the schema lacks."""
    from rlhf.spec.errors import SpecError

    cls: Optional[type] = schema.RunConfig
    owner: type = schema.RunConfig
    node: Any = cfg
    found: Optional[tuple[dataclasses.Field, Optional[type], Any]] = None
    for part in key.split("."):
        if cls is None:
            found = None
            break
        owner = cls
        found = next(((f, s, c) for f, s, c in _children(cls, node) if f.name == part), None)
        if found is None:
            break
        _, cls, node = found
    if found is None:
        keys = all_keys(cfg)
        near = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
        if not near:  # a right name under the wrong section: match the last part alone
            last = difflib.get_close_matches(key.split(".")[-1], {k.split(".")[-1] for k in keys}, n=3, cutoff=0.7)
            near = [k for k in keys if k.split(".")[-1] in last][:3]
        sections = ", ".join(f.name for f in dataclasses.fields(schema.RunConfig))
        hint = f"did you mean {' or '.join(near)}?" if near else f"the sections: {sections}"
        raise SpecError([f"--describe {key}: no such config key; {hint} (the keys: rlhf/spec/schema.py)"])
    f, sub, node = found
    lines = _entry(key, f, sub, node) + _items(owner, f, key, "")
    if sub is not None:
        lines += _section(sub, node, key + ".")
    return "\n".join(lines)


def _items(owner: type, f: dataclasses.Field, key: str, indent: str) -> list[str]:
    """The fields of each item of a list of sections (``reward.functions[].fn``), with their defaults."""
    args = typing.get_args(typing.get_type_hints(owner)[f.name])
    if typing.get_origin(typing.get_type_hints(owner)[f.name]) is not list or not args:
        return []
    if not dataclasses.is_dataclass(args[0]):
        return []
    lines: list[str] = []
    for item in dataclasses.fields(args[0]):
        if not item.name.startswith("_"):
            lines += _entry(f"{key}[].{item.name}", item, None, None, indent=indent + "  ")
    return [line.replace(" once the section is set)", " in each item)") for line in lines]


def _section(cls: type, node: Any, prefix: str) -> list[str]:
    lines: list[str] = []
    for f, sub, child in _children(cls, node):
        lines += _entry(prefix + f.name, f, sub, child, indent="  ")
        lines += _items(cls, f, prefix + f.name, "  ")
        if sub is not None:
            lines += _section(sub, child, prefix + f.name + ".")
    return lines
