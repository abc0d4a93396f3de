"""The agent loop: many chat trajectories advanced concurrently, none waiting for another.

Each trajectory is its own asyncio task:

    render the first messages → ids
    repeat: sample(ids) → parse the turn for tool calls → no call: done
            → run the calls (concurrently; in the tool threads or the sandbox pool, never on the
              event loop) → append the tool answers' delta ids → next turn

so while one trajectory waits for a slow tool, the others keep asking the engine for turns. The
engine is reached through one coroutine, per request:

    sample(token_ids: list[int], max_new_tokens: int, seed: int | None) -> Sampled | (ids, logprobs)

which continues exactly ``token_ids`` and returns the sampled ids (ending with the stop token when
it stopped), the log-prob of each, and the finish reason ("stop" | "length"; inferred from the
last id when a tuple is returned). An engine that batches requests (vLLM's async engine,
continuous batching) turns concurrent calls into full batches; nothing here waits for a batch.

Limits per trajectory (``TrajectoryLimits``): assistant turns, tool calls, total tokens (prompt
and everything after; optionally everything after the prompt alone), wall time. A limit ends the trajectory after the turn that reached it;
``Trajectory.finish`` names it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from rlhf.agent.parsers import ToolCallParser, get_parser
from rlhf.agent.tools import ToolOutcome, ToolSet
from rlhf.agent.trajectory import ChatRenderer, Trajectory


@dataclass
class Sampled:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length


SampleFn = Callable[..., Awaitable[Union[Sampled, tuple]]]


@dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int = 4  # assistant turns
    max_tool_calls: int = 8
    max_total_tokens: int = 2048  # prompt + every turn + every tool answer
    max_new_tokens: int = 256  # per assistant turn (less when the total budget is nearer)
    max_wall_s: float = 300.0
    max_response_tokens: Optional[int] = None  # everything after the prompt (turns, tool answers); None = no cap


def _seed(base: Optional[int], index: int, turn: int) -> Optional[int]:
    # one seed per (trajectory, turn): the same run samples the same turns whatever the interleaving
    return None if base is None else (base * 1_000_003 + index * 7_919 + turn) % (2**31 - 1)


class AgentLoop:
    def __init__(self, sample: SampleFn, tokenizer: Any, tools: ToolSet, parser: Union[str, ToolCallParser] = "hermes",
                 limits: TrajectoryLimits = TrajectoryLimits(), seed: Optional[int] = None,
                 max_concurrency: Optional[int] = None):
        self.sample = sample
        self.tokenizer = tokenizer
        self.tools = tools
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.limits = limits
        self.seed = seed
        self.renderer = ChatRenderer(tokenizer, tools.schemas() or None)
        self._renderers = {tuple(tools.tools): self.renderer}
        self._stop_ids = {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}
        self.max_concurrency = max_concurrency

    def _as_sampled(self, out: Union[Sampled, tuple]) -> Sampled:
        if isinstance(out, Sampled):
            return out
        ids, logprobs = out[0], out[1]
        finish = out[2] if len(out) > 2 else ("stop" if ids and ids[-1] in self._stop_ids else "length")
        return Sampled(list(ids), list(logprobs), finish)

    def _renderer(self, tools: ToolSet) -> ChatRenderer:
        """The renderer of a tool set (its schemas are part of the prompt), one per distinct set."""
        key = tuple(tools.tools)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools.schemas() or None)
        return self._renderers[key]

    async def run_one(self, messages: Sequence[dict], row: Optional[dict] = None, index: int = 0,
                      gate: Optional[asyncio.Semaphore] = None, tools: Optional[ToolSet] = None) -> Trajectory:
        """One trajectory; ``index`` is its place in the step (it picks the sampling seeds);
        ``tools``: the tools its prompt offers (``ToolSet.subset``), else all of the loop's."""
        if gate is None:
            return await self._run_one(messages, row, index, tools or self.tools)
        async with gate:
            return await self._run_one(messages, row, index, tools or self.tools)

    async def _run_one(self, messages: Sequence[dict], row: Optional[dict], index: int,
                       tools: ToolSet) -> Trajectory:
        lim = self.limits
        t0 = time.monotonic()
        messages = [dict(m) for m in messages]
        renderer = self._renderer(tools)
        prompt = renderer.prompt_ids(messages)
        max_total = lim.max_total_tokens if lim.max_response_tokens is None else \
            min(lim.max_total_tokens, len(prompt) + lim.max_response_tokens)
        traj = Trajectory(token_ids=list(prompt), loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                          prompt_len=len(prompt), messages=messages, row=dict(row or {}))
        traj.finish = "tokens"
        while True:
            budget = min(lim.max_new_tokens, max_total - len(traj.token_ids))
            if budget <= 0:
                traj.finish = "tokens"
                break
            if time.monotonic() - t0 >= lim.max_wall_s:
                traj.finish = "wall"
                break
            out = self._as_sampled(await self.sample(list(traj.token_ids), budget,
                                                     seed=_seed(self.seed, index, traj.turns)))
            traj.append(out.ids, sampled=True, logprobs=out.logprobs)
            traj.turns += 1
            text = self.tokenizer.decode(out.ids, skip_special_tokens=False)
            content, _ = renderer.split_sampled(text)
            parsed = self.parser.parse(content)
            traj.messages.append({"role": "assistant", "content": content})
            if out.finish_reason == "length":
                traj.finish = "length"
                break
            if not parsed.calls and not parsed.errors:
                traj.finish = "stop"
                break
            if traj.turns >= lim.max_turns:
                traj.finish = "turns"
                break
            outcomes = await self._run_calls(traj, parsed, t0, tools)
            tool_msgs = [{"role": "tool", "name": o.name or "error", "content": o.content} for o in outcomes]
            _, delta = renderer.delta_ids(text, tool_msgs)
            traj.outcomes += outcomes
            traj.messages += tool_msgs
            if len(traj.token_ids) + len(delta) >= max_total:
                traj.finish = "tokens"
                break
            traj.append(delta, sampled=False)
            if traj.tool_calls >= lim.max_tool_calls and all(o.error == "limit" for o in outcomes):
                traj.finish = "tool_calls"
                break
        traj.wall_s = time.monotonic() - t0
        return traj

    async def _run_calls(self, traj: Trajectory, parsed, t0: float, tools: ToolSet) -> list[ToolOutcome]:
        """The turn's answers: unreadable calls first, then each call (in the order written, run
        together), calls past the budget answered without running."""
        out: list[ToolOutcome] = [tools.malformed(e) for e in parsed.errors]
        left = self.limits.max_tool_calls - traj.tool_calls - len(out)
        runnable = parsed.calls[: max(left, 0)]
        remaining = max(self.limits.max_wall_s - (time.monotonic() - t0), 0.001)
        results = await asyncio.gather(*[tools.call(c, timeout_s=remaining) for c in runnable])
        out += list(results)
        out += [tools.over_budget(c, self.limits.max_tool_calls) for c in parsed.calls[len(runnable):]]
        return out

    async def run_many(self, conversations: Sequence[Sequence[dict]], rows: Optional[Sequence[dict]] = None,
                       tools: Optional[Sequence[Optional[ToolSet]]] = None) -> list[Trajectory]:
        rows = rows if rows is not None else [{} for _ in conversations]
        tools = tools if tools is not None else [None] * len(conversations)
        gate = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        tasks = [asyncio.ensure_future(self.run_one(m, r, i, gate, t))
                 for i, (m, r, t) in enumerate(zip(conversations, rows, tools))]
        return list(await asyncio.gather(*tasks))

    def run(self, conversations: Sequence[Sequence[dict]], rows: Optional[Sequence[dict]] = None,
            tools: Optional[Sequence[Optional[ToolSet]]] = None) -> list[Trajectory]:
        """``run_many`` on a fresh event loop (for synchronous callers)."""
        return asyncio.run(self.run_many(conversations, rows, tools))
