"""Which node holds which ranks: the layout's global device indices split into nodes.

Device ``d`` is device ``d % devices_per_node`` of node ``d // devices_per_node``. The launcher
reserves each device on its node (``rlhf.launch.cluster``), ``--plan`` prints this map, and a
lost node is reported with the ranks it held (``rlhf.run``).
"""

from __future__ import annotations

from rlhf.spec.runspec import RunSpec


def rank_devices(spec: RunSpec) -> dict[str, tuple[int, ...]]:
    """role -> the device of each rank (rollout: the first device of each engine)."""
    out = {r: tuple(spec.layout.roles[r]) for r in spec.roles if r != "rollout"}
    if "rollout" in spec.roles:
        out["rollout"] = tuple(e[0] for e in spec.layout.engines)
    return out


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

