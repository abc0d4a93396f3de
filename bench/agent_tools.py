"""A deliberately slow ``lookup`` tool for the step-time comparison of scripts/agent_gpu.sh.

    agent.tools=["bench.agent_tools:lookup"]

It answers as ``builtin:lookup`` (the keymap task's table, same name and schema, so the prompts
render the same), but every ``RLHF_SLOW_TOOL_EVERY``-th call (default 64) first waits
``RLHF_SLOW_TOOL_S`` seconds (default 2). The wait is an ``asyncio.sleep``: the tool is ``async``,
as a tool that waits on a network service would be, so it holds none of the tool threads; a plain
function that sleeps would hold one of ``ToolSet``'s 8 while it waits. Calls are counted per
process (the driver's agent loop runs every tool), so which trajectories are hit depends on the
order calls arrive in, not on their content.
"""

from __future__ import annotations

import asyncio
import itertools
import os

_calls = itertools.count()


def slow_every() -> int:
    return max(1, int(os.environ.get("RLHF_SLOW_TOOL_EVERY", "64")))


def slow_seconds() -> float:
    return float(os.environ.get("RLHF_SLOW_TOOL_S", "2"))


async def lookup(key: str) -> str:
    """Look up the value stored under a key in the table.

    Args:
        key: the key, e.g. k3
    """
    from rlhf.agent.builtin_tools import lookup as table_lookup

    every = slow_every()
    if next(_calls) % every == every - 1:
        await asyncio.sleep(slow_seconds())
    return table_lookup(key)
