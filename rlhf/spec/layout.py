"""Which devices each role occupies: the placement's ``Layout``, derived from the hardware and
placement sections (hybrid: every role on every device; disaggregated: a share each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.spec import schema as S


@dataclass
class Layout(S.Frozen):
    """Which global device indices each role occupies; rollout engines are TP groups."""

    mode: str
    total_devices: int
    roles: dict[str, tuple[int, ...]]
    engines: tuple[tuple[int, ...], ...]

    @property
    def rollout_tp(self) -> int:
        return len(self.engines[0]) if self.engines else 1

    def world_size(self, role: str) -> int:
        return len(self.roles.get(role, ()))


def plan_layout(sections: dict[str, Any], roles: tuple[str, ...]) -> Layout:
    """Assign devices to roles. Assumes validation of counts already passed."""
    hw: S.HardwareSpec = sections["hardware"]
    pl: S.PlacementSpec = sections["placement"]
    total = hw.nodes * hw.devices_per_node
    tp = pl.rollout.tensor_parallel
    if pl.mode == "hybrid":
        role_devices = {r: tuple(range(total)) for r in roles}
        rollout_devices = tuple(range(total)) if "rollout" in roles else ()
        n_engines = pl.rollout.engines or max(total // tp, 1)
    else:
        counts = disaggregated_counts(pl, roles, total)
        role_devices, start = {}, 0
        for r in roles:
            role_devices[r] = tuple(range(start, start + counts[r]))
            start += counts[r]
        rollout_devices = role_devices.get("rollout", ())
        n_engines = pl.rollout.engines or max(len(rollout_devices) // tp, 1)
    engines = tuple(tuple(rollout_devices[i * tp:(i + 1) * tp]) for i in range(n_engines)) if rollout_devices else ()
    return Layout(mode=pl.mode, total_devices=total, roles=role_devices, engines=engines)


def disaggregated_counts(pl: S.PlacementSpec, roles: tuple[str, ...], total: int) -> dict[str, int]:
    """Device counts per role; 0 in the config means automatic.

    Automatic: rollout engines get a quarter of the devices (at least one engine); the actor gets
    the largest power of two that leaves one device for each other automatic role; those share
    what is left.
    """
    counts = {r: (getattr(pl, r) if r != "rollout" else pl.rollout.engines * pl.rollout.tensor_parallel) for r in roles}
    if "rollout" in roles and counts["rollout"] == 0:
        tp = pl.rollout.tensor_parallel
        counts["rollout"] = max(tp, (total // 4) // tp * tp)
    auto = [r for r in roles if counts[r] == 0]
    if not auto:
        return counts
    left = total - sum(counts.values())
    others = [r for r in auto if r != "actor"]
    if "actor" in auto:
        room = max(left - len(others), 1)
        counts["actor"] = 1 << (room.bit_length() - 1)
        left -= counts["actor"]
    for i, r in enumerate(others):
        counts[r] = max(left // len(others) + (1 if i < left % len(others) else 0), 1)
    return counts
