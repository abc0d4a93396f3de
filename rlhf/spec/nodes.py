"""Which node holds which ranks: the layout's global device indices split into nodes.

Device ``d`` is device ``d % devices_per_node`` of node ``d // devices_per_node``. The launcher
reserves each device on its node (``rlhf.launch.cluster``), ``--plan`` prints this map, and a
lost node is reported with the ranks it held (``rlhf.run``).
"""

from __future__ import annotations

from rlhf.spec.runspec import RunSpec


def held_devices(spec: RunSpec) -> dict[str, list[tuple[int, ...]]]:
    """role -> the devices of each rank (a rollout engine's: its TP group), in ``spec.roles`` order."""
    lay = spec.layout
    return {r: list(lay.engines) if r == "rollout" else [(d,) for d in lay.roles[r]] for r in spec.roles}


def rank_devices(spec: RunSpec) -> dict[str, tuple[int, ...]]:
    """role -> the device of each rank (rollout: the first device of each engine)."""
    return {r: tuple(devs[0] for devs in ranks) for r, ranks in held_devices(spec).items()}


def node_of(spec: RunSpec, device: int) -> int:
    return device // spec.hardware.devices_per_node


def node_ranks(spec: RunSpec) -> list[dict[str, tuple[int, ...]]]:
    """For each node: role -> the ranks of that role on it (rollout: engine indices), in role order."""
    out: list[dict[str, tuple[int, ...]]] = [{} for _ in range(spec.hardware.nodes)]
    for role, devs in rank_devices(spec).items():
        for rank, d in enumerate(devs):
            out[node_of(spec, d)].setdefault(role, ())
            out[node_of(spec, d)][role] += (rank,)
    return out

