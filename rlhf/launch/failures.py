"""A failed worker, as the run reports it: one line naming the worker (role, rank or engine, node,
GPUs), the phase and step it failed in, the cause, and the last checkpoint.

* a worker process that died (killed, out of host memory, crashed: Ray's ``RayActorError``), or the
  whole node it ran on;
* a rollout engine that died while the worker process lives: its kind names the errors that say
  so (``EngineKind.dead_errors``; vLLM raises ``EngineDeadError`` when its engine core is gone),
  matched by name: nothing here imports an engine;
* a collective that timed out: torch's NCCL watchdog or blocking wait (``DistBackendError``: a
  ``RuntimeError`` saying ``Watchdog caught collective operation timeout``), or gloo's ``Timed out
  waiting <N>ms``. By default torch's watchdog ends the worker process itself, so the end of a dead
  worker's stderr (in Ray's session logs, where it ran on this node) is read for that line too. The
  rank that reports it is waiting for another that stopped joining, so the line names the whole
  group and says where to look.

A worker that raised or died while the cluster started (its model load, its engine's start:
``rlhf.launch.cluster.ClusterStartError``) gets a line of its own, ``start_failure``.

The worker is found by its Ray actor id: a ``RayActorError`` carries the dead actor's, and a
``RayTaskError`` (an error raised inside a worker) names the actor that raised it in its first line.
The RL loop's ``Phases`` marks an exception with the phase and step it escaped from (``mark``).
CUDA out of memory is not here: it is a setting to change, ``rlhf.plan.oom``.
"""

from __future__ import annotations

import re
import time
from typing import Optional

from rlhf.launch.cluster import Cluster
from rlhf.plan.oom import causes
from rlhf.plan.render import ranges
from rlhf.rollout import registry as engines
from rlhf.spec.nodes import held_devices, node_of, rank_devices
from rlhf.spec.runspec import RunSpec

# torch's NCCL watchdog, its blocking wait (TORCH_NCCL_BLOCKING_WAIT=1), gloo; a work's "Timeout(ms)=" alone
# is not one: NCCL's other errors print it too
_TIMED_OUT = re.compile(r"Watchdog caught collective operation timeout|timed out in blocking wait|"
                        r"Timed out waiting \d+ ?ms for \w+ operation")
_WHERE = "_rlhf_where"


def mark(e: BaseException, phase: str, step: int) -> None:
    """Record on ``e`` the phase and step (1-based, as the console counts) it escaped from; the
    innermost mark is kept."""
    if getattr(e, _WHERE, None) is None:
        try:
            setattr(e, _WHERE, (phase, step))
        except AttributeError:  # pragma: no cover  (an exception type with __slots__)
            pass


def worker_failure(e: BaseException, cluster: Cluster) -> Optional[str]:
    """The one line for a dead worker, a dead rollout engine or a collective timeout; None for
    any other error."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return None
    timeout = collective_timeout(e)
    spec = getattr(cluster, "spec", None)
    kind = engines.kind(spec) if spec is not None and "rollout" in spec.roles else None
    engine = engine_dead(e, kind.dead_errors if kind is not None else ())
    died = isinstance(e, RayActorError)
    if timeout is None and engine is None and not died:
        return None
    actor_id = _actor_id(e)
    roles, rank = _roles_of(cluster, actor_id)
    if died and timeout is None and actor_id:  # torch's NCCL watchdog ends the process (its default)
        from rlhf.track.worker_logs import tail_for_actor  # rlhf/track: its stderr went to its log file

        spec = getattr(cluster, "spec", None)
        timeout = timeout_in(_stderr_tail(actor_id) + (tail_for_actor(spec, actor_id) if spec else ""))
    if engine is not None and "rollout" in roles:
        roles = ["rollout"]  # one process may hold several roles (CPU hybrid): the engine is the rollout's
    where = getattr(e, _WHERE, None)
    during = _during(where)
    ckpt = _last_checkpoint(cluster)
    if timeout is not None:
        return _timeout_line(cluster, roles, rank, timeout, where, died) + f" Cluster shut down.{ckpt}"
    if engine is not None:
        cause = kind.death(engine)
    else:
        cause = _cause_line(e)
        k = _worker_node(cluster, roles[0], rank) if roles else None
        if k is not None and actor_id:
            lost = _lost_node(cluster, k, actor_id)
            if lost is not None:  # Ray's cause would only say "its node has died"
                return f"{lost} was lost {during}. Cluster shut down.{ckpt}"
    return f"{_subject(cluster, roles, rank)} died {during}: {cause}. Cluster shut down.{ckpt}"


def start_failure(e: BaseException, roster: Cluster) -> Optional[str]:
    """The one line for a worker that raised or died while the cluster started (``e``: what it
    raised, ``roster``: ``ClusterStartError.roster``), e.g. vLLM stopping in its memory profiling;
    None when no worker of ``roster`` raised it."""
    roles, rank = _roles_of(roster, _actor_id(e))
    if not roles:
        return None
    return f"{_subject(roster, roles, rank)} failed while the cluster started: {_cause_line(e)}. Cluster shut down."


def engine_dead(e: BaseException, names: tuple[str, ...]) -> Optional[str]:
    """The class name of an engine-dead error (one of ``names``) in ``e``'s causes, or None."""
    return next((type(c).__name__ for c in causes(e) if type(c).__name__ in names), None)


def collective_timeout(e: BaseException) -> Optional[tuple[Optional[float], Optional[str], str]]:
    """``timeout_in`` the innermost of ``e``'s causes that says a collective timed out, or None."""
    found = None
    for c in causes(e):  # the innermost: a RayTaskError's own text is a traceback
        found = timeout_in(str(c)) or found
    return found


def timeout_in(text: str) -> Optional[tuple[Optional[float], Optional[str], str]]:
    """(seconds, "NCCL" or "gloo", the line) of the last line of an error or a log that says a
    collective timed out (None where the line does not say), or None."""
    lines = [ln for ln in text.splitlines() if _TIMED_OUT.search(ln)]
    if not lines:
        return None
    line = lines[-1]
    ms = re.search(r"Timeout\(ms\)=(\d+)", line) or re.search(r"Timed out waiting (\d+) ?ms", line)
    backend = "NCCL" if "NCCL" in line else "gloo" if "gloo" in line else None
    start = line.find("Watchdog caught")  # after torch's "terminate called ... what(): [PG ...]" preamble
    return (int(ms.group(1)) / 1000 if ms else None), backend, _first_line(line[max(start, 0):])


def _first_line(text: str) -> str:
    line = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().split("\n")[0]
    line = re.sub(r"^(\[[^\]]*\]\s*)+", "", line)  # torch's "[Rank 0]" and gloo's "[file.cc:78]" prefixes
    if len(line) > 400:  # a whole sentence or two (vLLM's are ~300 characters), cut between words
        line = line[:400].rsplit(" ", 1)[0] + " …"
    return line.rstrip(". ")  # the line goes on after it


def _cause_line(e: BaseException) -> str:
    """The innermost cause's first line (a RayTaskError's own first line is its worker's header)."""
    inner = list(causes(e))[-1]
    return _first_line(str(inner)) or type(inner).__name__


def _stderr_tail(actor_id: str, nbytes: int = 65536) -> str:
    """The end of a dead worker's stderr where it ran on this node (Ray keeps it among its session's
    logs as worker-<id>-<job>-<pid>.err); "" elsewhere or when Ray does not say."""
    try:
        import glob
        import os

        import ray
        from ray._private import state

        info = state.actors(actor_id=actor_id) or {}
        node = ray._private.worker._global_node
        if not info.get("Pid") or node is None or \
                info.get("Address", {}).get("NodeID") != ray.get_runtime_context().get_node_id():
            return ""
        text = ""
        for path in glob.glob(os.path.join(node.get_logs_dir_path(), f"worker-*-{info['Pid']}.err")):
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - nbytes))
                text += f.read().decode(errors="replace")
        return text
    except Exception:  # noqa: BLE001  (the line goes out without it)
        return ""


def _actor_id(e: BaseException) -> Optional[str]:
    """The Ray actor that raised ``e`` (a RayTaskError's header names it) or that died."""
    if any(c.__name__ == "RayTaskError" for c in type(e).__mro__):
        m = re.search(r"actor_id=([0-9a-f]{16,})", str(e).split("\n", 1)[0])
        return m.group(1) if m else None
    aid = getattr(e, "actor_id", None)
    return aid if isinstance(aid, str) else None


def _roles_of(cluster: Cluster, actor_id: Optional[str]) -> tuple[list[str], Optional[int]]:
    """The roles held by the actor (several when one process holds them: CPU hybrid) and its rank."""
    roles, rank = [], None
    if cluster is not None and actor_id:
        for name, group in cluster.groups.items():
            for r, w in enumerate(group.workers):
                if w._actor_id.hex() == actor_id:
                    roles.append(name)
                    rank = r
    return roles, rank


def _during(where: Optional[tuple[str, int]]) -> str:
    if where is None:
        return "during the run"
    phase, step = where
    return f"during {'the weight sync' if phase == 'sync' else f'the {phase} phase'} of step {step}"


def _subject(cluster: Cluster, roles: list[str], rank: Optional[int]) -> str:
    """``rollout engine 0 (GPU 1)``, ``actor rank 2 (node 1, GPU 2)``, or the process holding several."""
    if not roles:
        return "a worker process"
    k = _worker_node(cluster, roles[0], rank)
    if len(roles) > 1:
        who = f"the process holding the {', '.join(roles[:-1])} and {roles[-1]} workers (rank {rank})"
        return who + (f" on node {k}" if k is not None else "")
    role = roles[0]
    where = [f"node {k}"] if k is not None else []
    gpus = _worker_gpus(cluster, role, rank)
    if gpus:
        where.append(gpus)
    name = f"rollout engine {rank}" if role == "rollout" else f"{role} rank {rank}"
    return name + (f" ({', '.join(where)})" if where else "")


def _timeout_line(cluster: Cluster, roles: list[str], rank: Optional[int],
                  timeout: tuple[Optional[float], Optional[str], str], where: Optional[tuple[str, int]],
                  died: bool) -> str:
    seconds, backend, text = timeout
    spec = getattr(cluster, "spec", None)
    if backend is None:
        backend = "NCCL" if getattr(spec, "device", "") == "cuda" else "gloo"
    groups = [_group(cluster, r) for r in roles[:1]]
    if where is not None and where[0] == "sync" and spec is not None and roles[:1] != ["rollout"] \
            and not spec.layout.rollout_beside_training and engines.kind(spec).device_weights:
        groups.append(_group(cluster, "rollout"))  # the trainer broadcasts to the engines (rlhf.workers.sync_cuda)
    groups = [g for g in groups if g]
    what = f"{'an' if backend == 'NCCL' else 'a'} {backend} collective" + (f" of {' and '.join(groups)}" if groups else "")
    after = f" after {seconds:g} s" if seconds is not None else ""
    who = _subject(cluster, roles, rank) + (", whose process it ended" if died else "")
    links = ("the links between the GPUs failed (rerun with NCCL_DEBUG=WARN)" if backend == "NCCL"
             else "the network between the processes failed")
    return (f"{what} timed out{after} {_during(where)}, reported by {who}: {text}. Another rank stopped "
            "joining: its own error above is the cause (out of memory, a crash); with none, a rank ran longer "
            f"than torch's default collective timeout, which this run does not change, or {links}.")


def _group(cluster: Cluster, role: str) -> str:
    """``actor ranks 0-3 (GPUs 0-3)``, ``rollout engines 0-1 (GPUs 4-7)``: a role's whole group."""
    spec = getattr(cluster, "spec", None)
    if spec is None or role not in spec.roles:
        return ""
    ranks = held_devices(spec)[role]
    devs = tuple(sorted({d for rank in ranks for d in rank}))  # engines may share a device
    name, n = ("rollout engine" if role == "rollout" else f"{role} rank"), len(ranks)
    who = f"{name}s {ranges(tuple(range(n)))}" if n > 1 else f"{name} 0"
    if spec.device != "cuda":
        return who
    nodes = sorted({node_of(spec, d) for d in devs})
    if len(nodes) > 1:
        return f"{who} (nodes {ranges(tuple(nodes))})"
    return f"{who} ({_gpus(spec, devs)})"


def _gpus(spec: RunSpec, devs: tuple[int, ...]) -> str:
    """``GPU 3`` / ``GPUs 4-7``: devices numbered within their node."""
    local = tuple(d % spec.hardware.devices_per_node for d in devs)
    return f"{'GPU' if len(local) == 1 else 'GPUs'} {ranges(local)}"


def _last_checkpoint(cluster: Cluster) -> str:
    if cluster is None:
        return ""
    try:
        from rlhf.ckpt.manager import find_latest

        latest = find_latest(cluster.spec.run_dir)
    except Exception:  # noqa: BLE001  (the line goes out without it)
        return ""
    return (f" Last checkpoint: {latest.path} (step {latest.step}); continue with resume=<run dir>." if latest
            else " No checkpoint was written yet.")


def _worker_gpus(cluster: Cluster, role: str, rank: Optional[int]) -> Optional[str]:
    """``GPU 3`` (``GPUs 4-7`` for a tensor-parallel engine), numbered within its node, on a GPU run."""
    spec = getattr(cluster, "spec", None)
    if spec is None or spec.device != "cuda" or rank is None:
        return None
    return _gpus(spec, held_devices(spec)[role][rank])


def _worker_node(cluster: Cluster, role: str, rank: Optional[int]) -> Optional[int]:
    """The plan node of a role's rank, when the run has several nodes."""
    if cluster is None or not cluster.nodes or rank is None:
        return None

    return node_of(cluster.spec, rank_devices(cluster.spec)[role][rank])


def _lost_node(cluster: Cluster, k: int, actor_id: str, wait_s: float = 30.0) -> Optional[str]:
    """The subject of the error line, node K (Ray node ..., holding <its ranks>), when plan node
    ``k``, where the dead worker ran, is gone; None when the worker alone died.

    The GCS marks a node dead before the actors on it, and a worker that crashed on a live node
    is marked dead by its raylet: once the actor table says DEAD, the node table says whether
    the node went with it. The wait covers an actor whose death is not recorded yet.
    """
    from rlhf.spec.nodes import node_ranks

    spec, node_id = cluster.spec, cluster.nodes[k]
    try:
        import ray
        from ray._private import state

        deadline = time.monotonic() + wait_s
        while True:
            actor_dead = (state.actors(actor_id=actor_id) or {}).get("State") == "DEAD"
            info = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
            if not info.get("Alive", True):
                break
            if actor_dead or time.monotonic() > deadline:
                return None
            time.sleep(0.2)
    except Exception:  # noqa: BLE001  (no answer from Ray: report the worker alone)
        return None
    held = []
    for r, ranks in node_ranks(spec)[k].items():
        what = f"{spec.rollout_engine} engine" if r == "rollout" else f"{r} rank"
        held.append(f"{what}{'s' if len(ranks) > 1 else ''} {ranges(ranks)}")
    held_s = held[0] if len(held) == 1 else f"{', '.join(held[:-1])} and {held[-1]}"
    return f"node {k} (Ray node {node_id[:8]} at {info.get('NodeManagerAddress', '?')}, holding {held_s})"

