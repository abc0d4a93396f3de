"""Chat trajectories through the agent loop, against a scripted engine: the sampled ids are kept
exactly, the loss mask covers only them, the limits end trajectories, and trajectories do not
wait for each other (checked on the order of events, not on timings)."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from rlhf.agent.loop import AgentLoop, Sampled, TrajectoryLimits
from rlhf.agent.builtin_tools import load_tools
from rlhf.agent.tools import ToolSet, tool_from_function
from rlhf.agent.trajectory import ChatRenderer
from rlhf.spec.errors import UserError


@pytest.fixture(scope="module")
def tok():
    from rlhf.agent.chat_tokenizer import build_chat_tokenizer

    return build_chat_tokenizer()


def char_ids(tok, text: str) -> list[int]:
    """Ids of ``text`` one character at a time: a tokenisation the tokenizer itself would never
    produce for it, as a sampling policy may, so re-tokenising would give other ids."""
    out = []
    for piece in re.split(r"(<\|im_end\|>|<tool_call>|</tool_call>)", text):
        if piece in ("<|im_end|>", "<tool_call>", "</tool_call>"):
            out.append(tok.convert_tokens_to_ids(piece))
        else:
            for ch in piece:
                out += tok.encode(ch, add_special_tokens=False)
    return out


class ScriptedEngine:
    """Answers a conversation from its decoded text: ``policy(text) -> reply text``; records each
    request (ids in, ids out, seed) and an event log shared with the tools."""

    def __init__(self, tok, policy, log=None):
        self.tok, self.policy = tok, policy
        self.requests: list[tuple[list[int], list[int], int | None]] = []
        self.log = log if log is not None else []

    async def __call__(self, ids: list[int], max_new_tokens: int, seed=None):
        await asyncio.sleep(0)  # a real engine yields while it batches
        text = self.tok.decode(ids, skip_special_tokens=False)
        reply = char_ids(self.tok, self.policy(text))
        finish = "stop"
        if len(reply) > max_new_tokens:
            reply, finish = reply[:max_new_tokens], "length"
        logprobs = [-0.01 * (k + 1) for k in range(len(reply))]
        self.requests.append((list(ids), reply, seed))
        self.log.append(("sample", _user_key(text)))
        return Sampled(reply, logprobs, finish)


def _user_key(text: str) -> str:
    m = re.search(r"key (k\d)", text)
    return m.group(1) if m else "?"


def lookup_policy(text: str) -> str:
    """Call lookup for the asked key, then answer with the value the tool gave."""
    answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if answers:
        return f"The answer is {answers[-1]}<|im_end|>"
    call = json.dumps({"name": "lookup", "arguments": {"key": _user_key(text)}})
    return f"Let me look.\n<tool_call>\n{call}\n</tool_call><|im_end|>"


def convo(key: str) -> list[dict]:
    return [{"role": "system", "content": "Answer with the value."}, {"role": "user", "content": f"key {key}"}]


@pytest.fixture(scope="module")
def lookup_tools():
    ts = ToolSet(load_tools(["builtin:lookup"]))
    yield ts
    ts.close()


def run(coro):
    return asyncio.run(coro)


def test_assistant_tokens_are_exactly_the_sampled_ids_and_alone_in_the_loss(tok, lookup_tools):
    from rlhf.data.builtin import table

    engine = ScriptedEngine(tok, lookup_policy)
    loop = AgentLoop(engine, tok, lookup_tools, seed=5)
    trajs = loop.run([convo(k) for k in ("k1", "k2", "k3")])
    by_key = {}
    for ids_in, ids_out, _ in engine.requests:
        by_key.setdefault(_user_key(tok.decode(ids_in)), []).append((ids_in, ids_out))
    for traj, key in zip(trajs, ("k1", "k2", "k3")):
        assert traj.finish == "stop" and traj.turns == 2 and traj.tool_calls == 1
        assert traj.final_answer() == f"The answer is {table()[key]}"
        sampled_positions = set()
        for ids_in, ids_out in by_key[key]:
            n = len(ids_in)
            assert traj.token_ids[:n] == ids_in  # the engine continued exactly the trajectory so far
            assert traj.token_ids[n:n + len(ids_out)] == ids_out  # and its ids are kept as sampled
            assert traj.logprobs[n:n + len(ids_out)] == [-0.01 * (k + 1) for k in range(len(ids_out))]
            sampled_positions |= set(range(n, n + len(ids_out)))
            # re-tokenising the sampled text would have changed the ids: the test can tell
            assert tok.encode(tok.decode(ids_out), add_special_tokens=False) != ids_out
        assert {i for i, m in enumerate(traj.loss_mask) if m} == sampled_positions
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)
        assert traj.prompt_len == len(by_key[key][0][0]) and traj.response_mask[0] == 1
        # the sequence reads as the template's rendering of the conversation's messages
        renderer = ChatRenderer(tok, lookup_tools.schemas())
        closing = renderer.split_sampled(tok.decode(by_key[key][-1][1]))[1]
        assert tok.decode(traj.token_ids) + closing == renderer.render(traj.messages, generation_prompt=False)
        assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]


def test_seeds_differ_per_trajectory_and_turn_and_repeat(tok, lookup_tools):
    seeds = []
    for _ in range(2):
        engine = ScriptedEngine(tok, lookup_policy)
        AgentLoop(engine, tok, lookup_tools, seed=11).run([convo("k1"), convo("k2")])
        seeds.append(sorted((_user_key(tok.decode(i)), s) for i, _, s in engine.requests))
    assert seeds[0] == seeds[1]
    assert len({s for _, s in seeds[0]}) == 4


def test_a_template_that_rewrites_earlier_turns_is_refused(tok, lookup_tools):
    from rlhf.agent.chat_tokenizer import build_chat_tokenizer

    t2 = build_chat_tokenizer()
    t2.chat_template = "{% for m in messages[-2:] %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    renderer = ChatRenderer(t2, None)
    with pytest.raises(UserError, match="renders earlier turns differently"):
        renderer.continuation_text([{"role": "tool", "content": "x"}])


def test_a_tokenizer_without_template_is_refused(tok):
    from rlhf.models.builtin import build_tokenizer

    t = build_tokenizer()
    t.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        ChatRenderer(t, None)


def test_malformed_call_is_answered_and_the_model_tries_again(tok, lookup_tools):
    def policy(text):
        if "could not read the tool call" not in text:
            return '<tool_call>{"name": "lookup", "arguments": {"key": </tool_call><|im_end|>'
        if text.count("<tool_response>") == 1:  # the error: call again, right this time
            return lookup_policy(text.split("<tool_response>")[0])
        return lookup_policy(text)

    engine = ScriptedEngine(tok, policy)
    (traj,) = AgentLoop(engine, tok, lookup_tools).run([convo("k4")])
    assert [o.error for o in traj.outcomes] == ["malformed", None]
    assert traj.finish == "stop" and traj.turns == 3


def test_limits_end_trajectories_and_name_the_cause(tok, lookup_tools):
    always_call = lambda text: lookup_policy(text.split("<tool_response>")[0])  # noqa: E731 - never answers
    (t,) = AgentLoop(ScriptedEngine(tok, always_call), tok, lookup_tools,
                     limits=TrajectoryLimits(max_turns=3)).run([convo("k1")])
    assert t.finish == "turns" and t.turns == 3 and t.truncated and t.tool_calls == 2

    def three_calls(text):
        call = json.dumps({"name": "lookup", "arguments": {"key": "k1"}})
        return f"<tool_call>{call}</tool_call>" * 3 + "<|im_end|>"

    (t,) = AgentLoop(ScriptedEngine(tok, three_calls), tok, lookup_tools,
                     limits=TrajectoryLimits(max_tool_calls=2, max_turns=5)).run([convo("k1")])
    assert [o.error for o in t.outcomes] == [None, None, "limit", "limit", "limit", "limit"]
    assert t.finish == "tool_calls" and t.turns == 2

    (t,) = AgentLoop(ScriptedEngine(tok, lookup_policy), tok, lookup_tools,
                     limits=TrajectoryLimits(max_new_tokens=10)).run([convo("k1")])
    assert t.finish == "length" and t.turns == 1 and sum(t.loss_mask) == 10

    engine = ScriptedEngine(tok, lookup_policy)
    prompt_len = len(ChatRenderer(tok, lookup_tools.schemas()).prompt_ids(convo("k1")))
    (t,) = AgentLoop(engine, tok, lookup_tools,
                     limits=TrajectoryLimits(max_total_tokens=prompt_len + 80)).run([convo("k1")])
    assert t.finish in ("tokens", "length") and len(t.token_ids) <= prompt_len + 80


def test_a_tool_past_the_wall_limit_times_out(tok):
    release = threading.Event()

    def slow(key: str) -> str:
        """Slow lookup."""
        release.wait(20)
        return "late"

    ts = ToolSet([tool_from_function(slow, name="lookup", timeout_s=60)])
    try:
        (t,) = AgentLoop(ScriptedEngine(tok, lookup_policy), tok, ts,
                         limits=TrajectoryLimits(max_wall_s=0.5)).run([convo("k1")])
    finally:
        release.set()
        ts.close()
    assert t.outcomes[0].error == "timeout" and t.finish == "wall"


def test_trajectories_progress_while_one_waits_for_a_slow_tool(tok):
    """Trajectory k0's tool blocks (in a tool thread) until the test releases it; the release comes
    only after every other trajectory has finished all its turns. A loop that advanced
    trajectories turn by turn together would never get there (the guard timeout turns that hang
    into a failure)."""
    log: list[tuple[str, str]] = []
    started, release = threading.Event(), threading.Event()

    def lookup(key: str) -> str:
        """Look up, slowly for k0."""
        log.append(("tool start", key))
        if key == "k0":
            started.set()
            release.wait(60)
        log.append(("tool end", key))
        return {"k0": "v0"}.get(key, "v1")

    ts = ToolSet([tool_from_function(lookup)])
    engine = ScriptedEngine(tok, lookup_policy, log=log)
    loop = AgentLoop(engine, tok, ts)

    async def main():
        keys = ["k0", "k1", "k2", "k3", "k4"]
        tasks = [asyncio.ensure_future(loop.run_one(convo(k), index=i)) for i, k in enumerate(keys)]
        others = await asyncio.wait_for(asyncio.gather(*tasks[1:]), timeout=60)
        assert started.is_set() and not tasks[0].done()
        snapshot = list(log)
        release.set()
        first = await asyncio.wait_for(tasks[0], timeout=60)
        return first, others, snapshot

    try:
        first, others, snapshot = run(main())
    finally:
        release.set()
        ts.close()
    assert all(t.finish == "stop" and t.turns == 2 for t in [first, *others])
    # while k0's tool was running, every other trajectory sampled both its turns and ran its tool
    assert ("tool start", "k0") in snapshot and ("tool end", "k0") not in snapshot
    for k in ("k1", "k2", "k3", "k4"):
        assert snapshot.count(("sample", k)) == 2 and ("tool end", k) in snapshot


def test_a_tuple_from_the_engine_is_read_with_its_finish_from_the_stop_token(tok, lookup_tools):
    engine = ScriptedEngine(tok, lookup_policy)

    async def as_tuple(ids, max_new_tokens, seed=None):
        s = await engine(ids, max_new_tokens, seed)
        return s.ids, s.logprobs

    (t,) = AgentLoop(as_tuple, tok, lookup_tools).run([convo("k2")])
    assert t.finish == "stop" and t.turns == 2
