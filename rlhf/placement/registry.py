"""Placements by name: ``placement.mode=<name>`` picks a ``PlacementKind``, which says which roles
share devices. Torch-free (the spec and ``--plan`` read it).

A kind's ``pools(roles)`` are groups of roles; the roles of one pool share its devices (each rank
takes an equal share of its device; they take turns), and different pools have devices of their
own. ``hybrid`` is one pool of every role; ``disaggregated`` a pool per role. A plugin names others:

    @register_placement                              # in a module named in placement.plugins
    class ActorWithReference(PlacementKind):
        name = "actor_with_reference"
        def pools(self, roles):
            return together(roles, ("actor", "reference"))

A pool's device count is the largest of its roles' ``placement.<role>`` counts (0 = automatic:
the rollout pool a quarter of the devices, the actor's pool the largest power of two that leaves
one device for each other pool, the others share the rest; ``rlhf.placement.layout``). Rollout
engines share devices either with every role (one pool) or with none: a pool of some roles and
the engines has no memory schedule yet, and validation says so.
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

from rlhf.plugins import import_problem


class PlacementKind:
    name: str = ""

    def pools(self, roles: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """The run's roles in groups that share devices, in ``roles`` order of their first role."""
        raise NotImplementedError


class Hybrid(PlacementKind):
    """Every role on every device; training and generation take turns each step."""

    name = "hybrid"

    def pools(self, roles: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        return (tuple(roles),)


class Disaggregated(PlacementKind):
    """Each role on devices of its own: no switching, fewer devices each."""

    name = "disaggregated"

    def pools(self, roles: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        return tuple((r,) for r in roles)


def together(roles: tuple[str, ...], *groups: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Pools where each of ``groups`` (those of its roles the run has) shares devices and every
    other role has its own, ordered by their first role."""
    out: list[tuple[str, ...]] = []
    placed: set[str] = set()
    for r in roles:
        if r in placed:
            continue
        group = next((g for g in groups if r in g), (r,))
        pool = tuple(x for x in roles if x in group)
        placed.update(pool)
        out.append(pool)
    return tuple(out)


class RegistryError(ValueError):
    """An unknown placement, or a name registered twice."""


_KINDS: dict[str, PlacementKind] = {}
BUILTINS = ("hybrid", "disaggregated")


def register_placement(cls: type[PlacementKind]) -> type[PlacementKind]:
    """Class decorator: register a placement under ``cls.name``."""
    if not cls.name:
        raise RegistryError(f"{cls.__module__}.{cls.__qualname__}: a placement needs a name")
    if cls.name in _KINDS:
        old = type(_KINDS[cls.name])
        raise RegistryError(f"placement {cls.name!r} is registered twice: by {old.__module__}.{old.__qualname__} and "
                            f"by {cls.__module__}.{cls.__qualname__}. Choose another name.")
    _KINDS[cls.name] = cls()
    return cls


register_placement(Hybrid)
register_placement(Disaggregated)


def load_plugins(modules: Sequence[str]) -> None:
    for name in modules:
        importlib.import_module(name)


def names(plugins: Sequence[str] = ()) -> tuple[str, ...]:
    load_plugins(plugins)
    return tuple(_KINDS)


def get(name: str, plugins: Sequence[str] = ()) -> PlacementKind:
    if name not in _KINDS:
        load_plugins(plugins)
    if name not in _KINDS:
        raise RegistryError(f"placement.mode={name!r} is not valid. Choose one of: {', '.join(names(plugins))} "
                            "(or register another in a module named in placement.plugins).")
    return _KINDS[name]


def plugin_problem(module: str) -> Optional[str]:
    """None if module ``module`` imports, else one line naming it, the error and the fix."""
    return import_problem("placement.plugins", module)
