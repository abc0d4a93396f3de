"""The hardware's device counts and memory, and the placement section (its rules are the
placement package's, ``rlhf.placement.layout.problems``)."""

from __future__ import annotations

from typing import Optional

from rlhf.placement.layout import problems as layout_problems
from rlhf.spec.rules import Sections


def device_counts(s: Sections) -> list[str]:
    """hardware.nodes and devices_per_node: every later rule counts devices with them."""
    hw = s["hardware"]
    if hw.nodes < 1 or hw.devices_per_node < 1:
        return [f"hardware.nodes={hw.nodes}, hardware.devices_per_node={hw.devices_per_node}: both must be >= 1."]
    return []


def problems(s: Sections, roles: tuple[str, ...], shape_from: Optional[str] = None) -> list[str]:
    """The memory of a device and a node, then the placement section's rules. ``shape_from``: where
    the model's architecture numbers came from when not from its model group."""
    hw, p = s["hardware"], []
    if hw.accelerator == "cuda" and hw.device_memory_gb <= 0:
        p.append(f"hardware.device_memory_gb={hw.device_memory_gb} must be > 0 for GPUs (CUDA's total in GB: 84.9 for an H100).")
    if hw.host_memory_gb < 0:
        p.append(f"hardware.host_memory_gb={hw.host_memory_gb} must be >= 0 (GB of memory per node; 0 = not checked).")
    return p + layout_problems(s, roles, shape_from)
