"""The ``Layout``: which devices each role occupies and which roles share them, derived once from
the hardware and placement sections (``plan_layout``) and kept in the spec (``RunSpec.layout``).
The launcher, the schedule, the plan and the failure lines ask it; none compares placement names.
Also the placement section's rules (``problems``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlhf.placement import registry as placements
from rlhf.spec import schema as S

TRAINED = ("actor", "critic")
ONE_POOL_GROUP = "devices"  # the placement group of a placement with one pool (hybrid)
# placement.rollout.engines_per_device's numbers (beside auto, which rlhf.plan.auto decides)
ENGINES_PER_DEVICE = (1, 2, 4)


@dataclass
class Layout(S.Frozen):
    """Which global device indices each role occupies; rollout engines are TP groups, and engines
    that share a device (``placement.rollout.engines_per_device``) list the same one, one after
    another; ``pools``: the roles that share devices (a placement group each)."""

    mode: str  # the placement's name, for the plan's title
    total_devices: int
    roles: dict[str, tuple[int, ...]]
    engines: tuple[tuple[int, ...], ...]
    pools: tuple[tuple[str, ...], ...] = ()

    @property
    def rollout_tp(self) -> int:
        return len(self.engines[0]) if self.engines else 1

    @property
    def engines_per_device(self) -> int:
        """The most rollout engines on one device (1 unless ``placement.rollout.engines_per_device``)."""
        counts: dict[int, int] = {}
        for devs in self.engines:
            for d in devs:
                counts[d] = counts.get(d, 0) + 1
        return max(counts.values(), default=1)

    @property
    def rollout_devices(self) -> tuple[int, ...]:
        """The devices holding rollout engines, each once, in order."""
        return tuple(dict.fromkeys(d for devs in self.engines for d in devs))

    def world_size(self, role: str) -> int:
        return len(self.roles.get(role, ()))

    @property
    def one_pool(self) -> bool:
        """Every role on every device (hybrid): training and generation take turns on each."""
        return len(self.pools) == 1

    def pool_of(self, role: str) -> tuple[str, ...]:
        return next((p for p in self.pools if role in p), ())

    def shares(self, a: str, b: str) -> bool:
        """Roles ``a`` and ``b`` run on the same devices."""
        return b in self.pool_of(a)

    @property
    def rollout_beside_training(self) -> bool:
        """The rollout engines share devices with a trained role: the schedule may move memory
        between the phases, and the weights go by CUDA IPC rather than NCCL."""
        return any(self.shares("rollout", r) for r in TRAINED)

    def group_name(self, pool: tuple[str, ...]) -> str:
        """The placement group of ``pool``: ``devices`` for the one pool, else its roles."""
        return ONE_POOL_GROUP if self.one_pool else "+".join(pool)

    def figure(self, role: str, generating: bool = False) -> str:
        """The name of the memory figure that holds ``role`` (``rlhf.plan.memory.estimate``): a
        phase of the one pool, else its pool's roles (``actor``, ``actor + reference``)."""
        if self.one_pool:
            return "generation phase" if generating else "training phase"
        return " + ".join(self.pool_of(role)) or role


def plan_layout(sections: dict[str, Any], roles: tuple[str, ...]) -> Layout:
    """Assign devices to roles. Assumes validation of counts already passed."""
    hw: S.HardwareSpec = sections["hardware"]
    pl: S.PlacementSpec = sections["placement"]
    total = hw.nodes * hw.devices_per_node
    tp = pl.rollout.tensor_parallel
    per = engines_per_device(pl)
    pools = placements.get(pl.mode, pl.plugins).pools(roles)
    if len(pools) == 1:
        role_devices = {r: tuple(range(total)) for r in roles}
        rollout_devices = tuple(range(total)) if "rollout" in roles else ()
        n_engines = pl.rollout.engines or max(total // tp, 1) * per
    else:
        counts = pool_counts(pl, pools, total)
        role_devices, start = {}, 0
        for pool in pools:
            for r in pool:
                role_devices[r] = tuple(range(start, start + counts[pool]))
            start += counts[pool]
        role_devices = {r: role_devices[r] for r in roles}
        rollout_devices = role_devices.get("rollout", ())
        n_engines = pl.rollout.engines or max(len(rollout_devices) // tp, 1) * per
    # engine i on TP group i // per: the engines sharing a device are neighbours
    engines = tuple(tuple(rollout_devices[i // per * tp:(i // per + 1) * tp])
                    for i in range(n_engines)) if rollout_devices else ()
    return Layout(mode=pl.mode, total_devices=total, roles=role_devices, engines=engines, pools=pools)


def engines_per_device(pl: S.PlacementSpec) -> int:
    """``placement.rollout.engines_per_device`` as a number; ``auto`` (before ``rlhf.plan.auto``
    decides it) and a value validation refuses count as 1."""
    v = pl.rollout.engines_per_device
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v in ENGINES_PER_DEVICE else 1


def _configured(pl: S.PlacementSpec, role: str) -> int:
    if role == "rollout":  # engines that share a device take one TP group
        return -(-pl.rollout.engines // engines_per_device(pl)) * pl.rollout.tensor_parallel
    return getattr(pl, role)


def pool_counts(pl: S.PlacementSpec, pools: tuple[tuple[str, ...], ...], total: int) -> dict[tuple[str, ...], int]:
    """Device counts per pool: the largest of its roles' counts, 0 in the config meaning automatic.

    Automatic: the rollout pool gets a quarter of the devices (at least one engine); the actor's
    pool the largest power of two that leaves one device for each other automatic pool; those
    share what is left.
    """
    counts = {p: max(_configured(pl, r) for r in p) for p in pools}
    rollout = next((p for p in pools if "rollout" in p), None)
    if rollout is not None and counts[rollout] == 0:
        tp = pl.rollout.tensor_parallel
        counts[rollout] = max(tp, (total // 4) // tp * tp)
    auto = [p for p in pools if counts[p] == 0]
    if not auto:
        return counts
    left = total - sum(counts.values())
    actor = next((p for p in auto if "actor" in p), None)
    others = [p for p in auto if p is not actor]
    if actor is not None:
        room = max(left - len(others), 1)
        counts[actor] = 1 << (room.bit_length() - 1)
        left -= counts[actor]
    for i, p in enumerate(others):
        counts[p] = max(left // len(others) + (1 if i < left % len(others) else 0), 1)
    return counts


def disaggregated_counts(pl: S.PlacementSpec, roles: tuple[str, ...], total: int) -> dict[str, int]:
    """Device counts per role when each role has its own devices (``pool_counts`` of one-role pools)."""
    return {p[0]: n for p, n in pool_counts(pl, tuple((r,) for r in roles), total).items()}


# ----------------------------------------------------------------------------- the section's rules


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_splits_heads(m: Any, tp: int) -> bool:
    """vLLM's rule: query heads divide by TP; KV heads divide by TP, or TP by them (replication)."""
    kv_ok = m.n_kv_heads % tp == 0 if m.n_kv_heads >= tp else tp % m.n_kv_heads == 0
    return m.n_heads % tp == 0 and kv_ok


def problems(s: dict[str, Any], roles: tuple[str, ...], shape_from: Optional[str] = None) -> list[str]:
    """The placement section's problems, one line each: its kind (and plugins), the rollout TP,
    and the device counts of its pools."""
    hw, pl = s["hardware"], s["placement"]
    p = [msg for msg in map(placements.plugin_problem, pl.plugins) if msg is not None]
    if p:
        return p
    known = placements.names(pl.plugins)
    if pl.mode not in known:
        return [f"placement.mode={pl.mode!r} is not valid. Choose one of: {', '.join(known)}."]
    pools = placements.get(pl.mode).pools(roles)
    total = hw.nodes * hw.devices_per_node
    if len(pools) == 1:
        for r in ("actor", "critic", "reference", "teacher", "reward"):
            if getattr(pl, r):
                p.append(
                    f"placement.{r}={getattr(pl, r)} only applies to placement=disaggregated: in {pl.mode} "
                    f"placement every role spans all {total} devices. Drop it, or use placement=disaggregated."
                )
    if pl.rollout.engines < 0:
        p.append(f"placement.rollout.engines={pl.rollout.engines} must be >= 0 (0 = as many as fit).")
    tp = pl.rollout.tensor_parallel
    per = pl.rollout.engines_per_device
    if per != "auto" and (not isinstance(per, int) or isinstance(per, bool) or per not in ENGINES_PER_DEVICE):
        p.append(f"placement.rollout.engines_per_device={per} is not valid. Choose one of: auto, "
                 f"{', '.join(map(str, ENGINES_PER_DEVICE))}.")
    elif per != "auto" and per > 1 and tp != 1:
        p.append(f"placement.rollout.engines_per_device={per} needs placement.rollout.tensor_parallel=1 (it is "
                 f"{tp}): engines that share a device take one GPU each. Use engines_per_device=1, or "
                 "tensor_parallel=1 for a model one GPU holds.")
    per = engines_per_device(pl)
    if tp < 1 or tp > hw.devices_per_node:
        p.append(
            f"placement.rollout.tensor_parallel={tp} must be between 1 and the GPUs of one node "
            f"(hardware.devices_per_node={hw.devices_per_node}): tensor parallelism does not cross nodes."
        )
    elif "rollout" in roles:
        m = s["model"]
        if not tp_splits_heads(m, tp):
            ok = [d for d in divisors(hw.devices_per_node) if tp_splits_heads(m, d)]
            p.append(
                f"placement.rollout.tensor_parallel={tp} does not split the {m.n_heads} attention heads "
                f"({m.n_kv_heads} KV heads) of {shape_from or f'model={m.name}'} evenly over the TP ranks, "
                "as vLLM requires. "
                f"Use one of: {', '.join(str(d) for d in ok)}."
            )
        if len(pools) == 1:
            engines = pl.rollout.engines or total // tp * per
            if hw.devices_per_node % tp:
                ok = ", ".join(str(d) for d in divisors(hw.devices_per_node) if tp_splits_heads(m, d))
                p.append(
                    f"placement.rollout.tensor_parallel={tp} does not divide the {hw.devices_per_node} GPUs of a "
                    f"node, which {pl.mode} placement gives to rollout engines (hardware={hw.name}). Use one of: {ok}."
                )
            elif -(-engines // per) * tp > total:
                shared = f" at engines_per_device={per}" if per > 1 else ""
                p.append(
                    f"placement.rollout.engines={engines} × tensor_parallel={tp} needs {-(-engines // per) * tp} "
                    f"devices{shared}, but hardware={hw.name} has {total}. Use placement.rollout.engines="
                    f"{total // tp * per} (or 0 = all)."
                )
    if len(pools) > 1:
        partial = [pool for pool in pools if "rollout" in pool and len(pool) > 1]
        if partial:
            p.append(f"placement={pl.mode} puts the rollout engines beside {', '.join(r for r in partial[0] if r != 'rollout')} "
                     "only: rollout engines share devices with every role (placement=hybrid) or with none.")
        if 1 <= tp <= hw.devices_per_node and pl.rollout.engines >= 0:
            _pool_problems(p, s, roles, pools, total, tp)
    return p


def _pool_problems(p: list[str], s: dict[str, Any], roles: tuple[str, ...], pools: tuple[tuple[str, ...], ...],
                   total: int, tp: int) -> None:
    hw, pl = s["hardware"], s["placement"]
    counts = {" + ".join(pool): n for pool, n in pool_counts(pl, pools, total).items()}
    need = sum(counts.values())
    if need > total:
        detail = ", ".join(f"{r} {n}" for r, n in counts.items())
        p.append(
            f"placement={pl.mode} needs {need} devices ({detail}) but hardware={hw.name} has "
            f"{total}. Lower the per-role counts (0 = automatic), use bigger hardware, or placement=hybrid."
        )
    if counts.get("rollout", 0) % tp:
        ok = [d for d in divisors(counts["rollout"]) if d <= hw.devices_per_node]
        p.append(
            f"placement.rollout.tensor_parallel={tp} does not divide the {counts['rollout']} devices given "
            f"to rollout engines (placement.rollout.engines={pl.rollout.engines}). "
            f"Use tensor_parallel {', '.join(str(d) for d in ok)}, or engines × tensor_parallel devices."
        )
    elif tp > 1 and need <= total and "rollout" in counts:
        _engines_within_nodes(p, hw, counts, tp)
    for r in ("critic", "reference", "teacher", "reward"):
        if r not in roles and getattr(pl, r):
            p.append(
                f"placement.{r}={getattr(pl, r)} gives devices to a role this run does not have "
                f"(algo={s['algo'].name}). Set placement.{r}=0."
            )


def _engines_within_nodes(p: list[str], hw: Any, counts: dict[str, int], tp: int) -> None:
    """Disaggregated engines take the last devices (plan_layout); a TP group must
    not cross a node boundary."""
    dpn = hw.devices_per_node
    start = sum(counts.values()) - counts["rollout"]
    for i in range(counts["rollout"] // tp):
        first, last = start + i * tp, start + (i + 1) * tp - 1
        if first // dpn != last // dpn:
            before = ", ".join(f"placement.{r}={n}" for r, n in counts.items() if r != "rollout")
            p.append(
                f"placement.rollout.tensor_parallel={tp}: rollout engine {i} would take devices {first}-{last}, "
                f"on nodes {first // dpn} and {last // dpn} of hardware={hw.name}, but tensor parallelism does not "
                f"cross nodes. Give the other roles ({before}) a multiple of {tp} devices in all."
            )
            return
