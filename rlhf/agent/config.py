"""The ``agent.*`` config: its validation (``problems``, called by rlhf.spec.validate) and the objects
the run builds from it (limits, sandbox pool, tools). Torch-free, like the spec."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional

from rlhf.spec.errors import UserError

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec

ISOLATIONS = ("auto", "bwrap", "unshare", "none")


def _tool_problem(i: int, entry: Any) -> Optional[str]:
    key = f"agent.tools[{i}]"
    if isinstance(entry, str):
        ref = entry
    elif isinstance(entry, dict) or hasattr(entry, "keys"):
        d = dict(entry)
        unknown = sorted(set(d) - {"fn", "name", "schema", "description", "timeout_s"})
        if unknown:
            return (f"{key} has unknown field(s) {', '.join(unknown)}. Use fn, name, schema, description, "
                    "timeout_s.")
        ref = d.get("fn")
        if not isinstance(ref, str):
            return f"{key}={d!r} needs fn=module:function or fn=builtin:<name>."
    else:
        return f"{key}={entry!r} is not valid. Give builtin:<name>, module:function, or {{fn: ..., name: ...}}."
    if ":" not in ref:
        return f"{key}={ref!r} must name a function as module:function, path/to/file.py:function or builtin:<name>."
    if ref.startswith("builtin:"):
        from rlhf.agent.builtin_tools import BUILTINS

        if ref.partition(":")[2] not in BUILTINS:
            return (f"{key}={ref!r} is not a built-in tool. Choose one of: "
                    f"{', '.join('builtin:' + b for b in BUILTINS)}.")
    return None


def problems(s: dict[str, Any]) -> list[str]:
    """Every problem of the ``agent`` section, one line each (naming the key, the value, a fix)."""
    ag = s.get("agent")
    if ag is None:
        return []
    p: list[str] = []
    algo = s["algo"]
    for i, entry in enumerate(ag.tools):
        msg = _tool_problem(i, entry)
        if msg:
            p.append(msg)
    for module in ag.plugins:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
            p.append(f"agent.plugins: module {module!r} does not import ({type(e).__name__}: {e}).")
    from rlhf.agent.parsers import parser_names

    if ag.parser not in parser_names():
        p.append(f"agent.parser={ag.parser!r} is not valid. Choose one of: {', '.join(parser_names())} "
                 "(or register another with @register_parser in a module named in agent.plugins).")
    lim = ag.limits
    for key in ("max_turns", "max_tool_calls"):
        if getattr(lim, key) < 1:
            p.append(f"agent.limits.{key}={getattr(lim, key)} must be >= 1.")
    if lim.max_turn_tokens is not None and lim.max_turn_tokens < 1:
        p.append(f"agent.limits.max_turn_tokens={lim.max_turn_tokens} must be >= 1, or null for "
                 "rollout.max_response_tokens.")
    if lim.max_wall_s <= 0:
        p.append(f"agent.limits.max_wall_s={lim.max_wall_s} must be > 0.")
    sb = ag.sandbox
    if sb.isolation not in ISOLATIONS:
        p.append(f"agent.sandbox.isolation={sb.isolation!r} is not valid. Choose one of: {', '.join(ISOLATIONS)}.")
    if sb.workers is not None and sb.workers < 1:
        p.append(f"agent.sandbox.workers={sb.workers} must be >= 1, or null for the CPU count.")
    for key in ("cpu_s", "wall_s", "memory_mb", "output_bytes"):
        if getattr(sb, key) <= 0:
            p.append(f"agent.sandbox.{key}={getattr(sb, key)} must be > 0.")
    if not ag.enabled:
        if ag.tools:
            p.append("agent.tools are set but agent.enabled=false: set agent.enabled=true to roll out with them, "
                     "or remove agent.tools.")
        return p
    if algo.kind != "rl":
        p.append(f"agent.enabled=true is for RL runs; algo.kind is {algo.kind!r}: set agent.enabled=false.")
        return p
    en = s.get("env")
    if en is not None and en.fn is not None:
        p.append("agent.enabled=true and env.fn are two multi-turn rollouts: choose one (remove env.fn, or set "
                 "agent.enabled=false).")
    if algo.async_steps > 0:
        p.append("agent.enabled=true with algo.async_steps > 0 is not supported: set algo.async_steps=0.")
    return p


def limits(spec: RunSpec) -> Any:
    """The run's ``TrajectoryLimits``: the whole trajectory within the rollout's token budget."""
    from rlhf.agent.loop import TrajectoryLimits

    lim, r = spec.agent.limits, spec.rollout
    return TrajectoryLimits(max_turns=lim.max_turns, max_tool_calls=lim.max_tool_calls,
                            max_total_tokens=r.max_prompt_tokens + r.max_response_tokens,
                            max_new_tokens=lim.max_turn_tokens or r.max_response_tokens, max_wall_s=lim.max_wall_s)


def sandbox_pool(spec: RunSpec) -> Any:
    """The run's ``SandboxPool`` (agent.sandbox), for builtin:python."""
    import os

    from rlhf.agent.sandbox import SandboxLimits, SandboxPool

    sb = spec.agent.sandbox
    lim = SandboxLimits(cpu_s=sb.cpu_s, wall_s=sb.wall_s, memory_mb=sb.memory_mb, output_bytes=sb.output_bytes)
    workers = sb.workers or max(1, min(8, os.cpu_count() or 1))
    return SandboxPool(lim, workers=workers, isolation=sb.isolation)


def needs_sandbox(spec: RunSpec) -> bool:
    return any((e if isinstance(e, str) else dict(e).get("fn")) == "builtin:python" for e in spec.agent.tools)


def import_plugins(spec: RunSpec) -> None:
    for module in spec.agent.plugins:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"agent.plugins: module {module!r} does not import ({type(e).__name__}: {e}).") from None
