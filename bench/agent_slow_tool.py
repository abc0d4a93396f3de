"""Step time with a slow tool: the agent loop (trajectories independent) vs a lock-step loop.

    python -m bench.agent_slow_tool [--trajectories 64] [--slow-s 1.0] [--repeats 3]

N trajectories of 4 assistant turns each (3 tool calls, then an answer) against a fake engine whose
every request takes ``--engine-ms`` whatever the number in flight (an idealised continuous-batching
engine: concurrency is free, so only waiting shows). The tool answers in about a millisecond,
except that on ``m`` of the turns one trajectory's call takes ``--slow-s`` (a different trajectory
each time, at turn 1, 2, 3). The agent loop's step time should stay at about one slow call plus
four engine turns whatever ``m``; a loop that advances all trajectories turn by turn waits for the
slow call on every turn where it happens: about ``m`` slow calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from rlhf.agent.loop import AgentLoop, Sampled, TrajectoryLimits
from rlhf.agent.parsers import get_parser
from rlhf.agent.tools import ToolSet, tool_from_function
from rlhf.agent.trajectory import ChatRenderer

TURNS = 4


def make_engine(tok, engine_ms: float):
    async def sample(ids: list[int], max_new_tokens: int, seed=None) -> Sampled:
        await asyncio.sleep(engine_ms / 1000)
        text = tok.decode(ids, skip_special_tokens=False)
        done = text.count("<tool_response>")
        key = text.rsplit("traj ", 1)[1].split("<", 1)[0].strip()
        if done >= TURNS - 1:
            reply = "done<|im_end|>"
        else:
            reply = "<tool_call>" + json.dumps({"name": "work", "arguments": {"who": key, "turn": done + 1}}) + \
                    "</tool_call><|im_end|>"
        out = tok.encode(reply, add_special_tokens=False)
        return Sampled(out, [-0.1] * len(out), "stop")

    return sample


def make_tools(slow_hits: int, slow_s: float) -> ToolSet:
    def work(who: str, turn: int) -> str:
        """Do a unit of work.

        Args:
            who: the trajectory
            turn: the turn
        """
        # trajectory j is slow at turn j+1, for the first slow_hits trajectories: each slow call
        # lands on a different turn and a different trajectory
        j = int(who)
        time.sleep(slow_s if (j < slow_hits and turn == j + 1) else 0.001)
        return "ok"

    return ToolSet([tool_from_function(work, timeout_s=60)], threads=64)


def convos(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"traj {i}"}] for i in range(n)]


async def lock_step(sample, tok, tools: ToolSet, n: int) -> None:
    """Every trajectory's turn k, then every tool call of turn k, then turn k + 1 (what a
    turn-synchronous environment loop does)."""
    renderer, parser = ChatRenderer(tok, tools.schemas()), get_parser("hermes")
    ids = [renderer.prompt_ids(c) for c in convos(n)]
    active = list(range(n))
    for _ in range(TURNS):
        outs = await asyncio.gather(*[sample(ids[i], 64) for i in active])
        nxt, pending = [], []
        for i, out in zip(active, outs):
            ids[i] += out.ids
            parsed = parser.parse(tok.decode(out.ids, skip_special_tokens=False))
            if parsed.calls:
                nxt.append(i)
                pending.append((i, out, asyncio.gather(*[tools.call(c) for c in parsed.calls])))
        for i, out, fut in pending:
            answers = await fut
            _, delta = renderer.delta_ids(tok.decode(out.ids, skip_special_tokens=False),
                                          [{"role": "tool", "content": a.content} for a in answers])
            ids[i] += delta
        active = nxt
        if not active:
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--engine-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from rlhf.agent.chat_tokenizer import build_chat_tokenizer

    tok = build_chat_tokenizer()
    sample = make_engine(tok, args.engine_ms)
    rows = []
    for m in range(TURNS):
        tools = make_tools(m, args.slow_s)
        times = {"agent_loop": [], "lock_step": []}
        for _ in range(args.repeats):
            loop = AgentLoop(sample, tok, tools, limits=TrajectoryLimits(max_turns=TURNS, max_tool_calls=TURNS))
            t0 = time.perf_counter()
            trajs = loop.run(convos(args.trajectories))
            times["agent_loop"].append(time.perf_counter() - t0)
            assert all(t.turns == TURNS and t.finish == "stop" for t in trajs), [t.finish for t in trajs]
            t0 = time.perf_counter()
            asyncio.run(lock_step(sample, tok, tools, args.trajectories))
            times["lock_step"].append(time.perf_counter() - t0)
        tools.close()
        row = {"slow_turns": m, **{k: round(statistics.median(v), 3) for k, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.trajectories} trajectories x {TURNS} turns, engine {args.engine_ms:g} ms/request, "
          f"slow call {args.slow_s:g} s; median step seconds of {args.repeats}")
    print("| turns with a slow call | agent loop | lock step |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['slow_turns']} | {r['agent_loop']:.2f} | {r['lock_step']:.2f} |")


if __name__ == "__main__":
    main()
