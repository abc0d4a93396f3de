"""Per-step metrics of agent trajectories (the ``agent/`` keys a step logs).

    agent/turns_mean, agent/turns_max              assistant turns per trajectory
    agent/tool_calls_mean, agent/tool_calls_max    tool answers per trajectory (errors included)
    agent/tool_errors/<kind>                       answers of each error kind in the step (tools.ERROR_KINDS)
    agent/tool_error_frac                          erroneous answers / all answers
    agent/tool_latency_p50, agent/tool_latency_p99 seconds, over the calls that ran a tool
    agent/sandbox_kills/<cause>                    sandbox kills in the step (sandbox.KILL_CAUSES)
    agent/truncated_frac                           trajectories cut by a limit
    agent/finish/<reason>                          fraction of trajectories ending each way
    agent/assistant_tokens_mean, agent/total_tokens_mean, agent/wall_s_max
"""

from __future__ import annotations

import math
from typing import Sequence

from rlhf.agent.sandbox import KILL_CAUSES
from rlhf.agent.tools import ERROR_KINDS
from rlhf.agent.trajectory import Trajectory

FINISHES = ("stop",) + Trajectory.TRUNCATIONS
# answers that ran a tool (the others are refused before any tool runs, at no cost)
_RAN = (None, "raised", "timeout", "sandbox")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (the
    "linear" method of Hyndman & Fan 1996, type 7); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    n = len(trajectories)
    if n == 0:
        return {}
    outcomes = [o for t in trajectories for o in t.outcomes]
    turns = [t.turns for t in trajectories]
    calls = [t.tool_calls for t in trajectories]
    m: dict[str, float] = {
        "agent/turns_mean": sum(turns) / n,
        "agent/turns_max": float(max(turns)),
        "agent/tool_calls_mean": sum(calls) / n,
        "agent/tool_calls_max": float(max(calls)),
        "agent/tool_error_frac": (sum(o.error is not None for o in outcomes) / len(outcomes)) if outcomes else 0.0,
        "agent/truncated_frac": sum(t.truncated for t in trajectories) / n,
        "agent/assistant_tokens_mean": sum(sum(t.loss_mask) for t in trajectories) / n,
        "agent/total_tokens_mean": sum(len(t.token_ids) for t in trajectories) / n,
        "agent/wall_s_max": max(t.wall_s for t in trajectories),
    }
    for kind in ERROR_KINDS:
        m[f"agent/tool_errors/{kind}"] = float(sum(o.error == kind for o in outcomes))
    for cause in KILL_CAUSES:
        m[f"agent/sandbox_kills/{cause}"] = float(sum(o.sandbox_kill == cause for o in outcomes))
    for f in FINISHES:
        m[f"agent/finish/{f}"] = sum(t.finish == f for t in trajectories) / n
    lat = [o.latency_s for o in outcomes if o.error in _RAN]
    m["agent/tool_latency_p50"] = percentile(lat, 50) if lat else 0.0
    m["agent/tool_latency_p99"] = percentile(lat, 99) if lat else 0.0
    return m
