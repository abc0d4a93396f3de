"""The agent loop wired into RL, without Ray: ``AgentRollout`` over stand-in rollout workers (a
scripted batched engine), what the trainer receives (ids, loss mask, log-probs exactly as sampled),
request batching, per-row tools, the code reward as a step's score, the agent.* config's one-line
errors, and SFT rendering a row's tools as the rollout's prompt does."""

from __future__ import annotations

import json

import pytest

from rlhf.rollout.engine import Sample, Sampling
from tests.helpers import assert_clear, make_spec

BASE = ["algo=grpo", "model=tiny-chat", "agent.enabled=true", "agent.tools=[builtin:lookup]", "data.prompt_key=messages",
        "data.train_files=[builtin:agent-lookup/train]", "reward.functions=[{fn: rlhf.rewards.builtin:keymap_reward}]",
        "algo.group_size=2", "train.prompts_per_step=4", "rollout.max_response_tokens=160"]


@pytest.fixture(scope="module")
def tok():
    from rlhf.agent.chat_tokenizer import build_chat_tokenizer

    return build_chat_tokenizer()


class ScriptedWorker:
    """A rollout worker whose engine answers from the decoded conversation: a lookup call for the
    user's key, then the tool's answer (or ``wrong`` for odd trajectories' seeds); records every
    batched call. ``.generate.remote`` returns the samples themselves (``ray.get`` is identity here)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []
        worker = self

        class _Generate:
            @staticmethod
            def remote(prompts, sampling):
                return worker.answer(prompts, sampling)

        self.generate = _Generate()

    def reply(self, text: str, seed) -> str:
        last = text.rsplit("<|im_start|>", 2)
        if "<tool_response>" in last[-2]:
            value = last[-2].split("<tool_response>\n")[1].split("\n")[0]
            return (value if seed is None or seed % 2 == 0 else "v9") + "<|im_end|>"
        key = text.split("key ")[-1].split("<|im_end|>")[0]
        return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "\n</tool_call><|im_end|>"

    def answer(self, prompts, sampling: Sampling) -> list[Sample]:
        self.calls.append((len(prompts), sampling))
        out = []
        for i, ids in enumerate(prompts):
            seed = sampling.seeds[i] if sampling.seeds else None
            text = self.tok.decode(ids, skip_special_tokens=False)
            # one id per character: not what encoding the text would give, so re-tokenising would show
            reply = [x for ch in self.reply(text, seed).replace("<|im_end|>", "\0") for x in
                     ([self.tok.eos_token_id] if ch == "\0" else self.tok.encode(ch, add_special_tokens=False))]
            out.append(Sample(reply, [-0.5 - 0.001 * k for k in range(len(reply))], "stop"))
        return out


@pytest.fixture
def rollout(tok, tmp_path, monkeypatch, rlhf_cache):
    import ray

    from rlhf.agent.rollout import AgentRollout

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    spec = make_spec(BASE, tmp_path / "x")
    workers = [ScriptedWorker(tok), ScriptedWorker(tok)]
    r = AgentRollout(spec, tok, workers)
    yield spec, r, workers
    r.close()


def test_the_trainer_gets_the_sampled_ids_their_logprobs_and_a_mask_on_them_alone(rollout, tok):
    import torch

    from rlhf.agent.config import limits
    from rlhf.data.agent_tasks import rows
    from rlhf.data.batch import collate
    from rlhf.envs.rollout import env_loss_mask
    from rlhf.rewards import Rewards
    from rlhf.rollout.generate import sampling_for

    spec, r, workers = rollout
    data = rows("agent-lookup", "train")[:4]
    samples, prompt_ids, stats = r.run(data, sampling_for(spec, 0, 0, 4))
    assert len(samples) == 8 and [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    sampled = []
    for s in samples:
        t = s.trajectory
        assert t.turns == 2 and t.tool_calls == 1 and t.finish == "stop"
        assert t.token_ids[: t.prompt_len] == prompt_ids[s.prompt_index]
        assert s.response_ids == t.token_ids[t.prompt_len:]
        assert len(s.loss_mask) == len(s.response_ids) == len(s.logprobs)
        # the masked spans are exactly the engine's replies, with its log-probs
        spans, cur = [], []
        for i, m in zip(s.response_ids, s.loss_mask):
            if m:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        spans.append(cur)
        assert len(spans) == 2 and spans[0][-1] == tok.eos_token_id == spans[1][-1]
        lps = [lp for lp, m in zip(s.logprobs, s.loss_mask) if m]
        assert lps == [-0.5 - 0.001 * k for k in range(len(spans[0]))] + [-0.5 - 0.001 * k for k in range(len(spans[1]))]
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
        assert tok.encode(tok.decode(spans[0]), add_special_tokens=False) != spans[0]  # re-tokenising would differ
        sampled.append(spans)
    # requests were batched: some generate call carried several trajectories' turns, and the
    # two workers shared the load
    assert max(n for w in workers for n, _ in w.calls) > 1 and all(w.calls for w in workers)
    assert stats["agent/turns_mean"] == 2.0 and stats["agent/tool_calls_mean"] == 1.0
    assert stats["agent/tool_errors/malformed"] == 0.0 and stats["agent/truncated_frac"] == 0.0
    assert limits(spec).max_total_tokens == spec.rollout.max_prompt_tokens + spec.rollout.max_response_tokens
    # the batch the trainer gets: mask 1 exactly on sampled ids
    batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                    tok.pad_token_id, None)
    mask = batch["response_mask"] * env_loss_mask(samples, batch["response_mask"].shape[1])
    for b, s in enumerate(samples):
        assert mask[b].tolist() == [float(m) for m in s.loss_mask] + [0.0] * (mask.shape[1] - len(s.loss_mask))
    # rewards score the final answer: even seeds copy the tool's answer (1.0), odd ones say v9
    rewards = Rewards(spec.reward)
    scores, parts = r.score(data, samples, rewards, type("C", (), {"reward_model": None})(), prompt_ids)
    rewards.close()
    from rlhf.data.builtin import score

    want = [score(s.trajectory.final_answer(), data[s.prompt_index]["answer"]) for s in samples]
    assert scores.tolist() == pytest.approx(want) and 1.0 in want and max(want) > min(want)
    assert isinstance(scores, torch.Tensor)


def test_a_rows_tools_column_picks_what_its_prompt_offers(rollout, tok):
    from rlhf.rollout.generate import sampling_for
    from rlhf.spec.errors import UserError

    spec, r, _ = rollout
    with_tool = {"messages": [{"role": "user", "content": "key k1"}], "answer": "v?", "tools": ["lookup"]}
    without = {"messages": [{"role": "user", "content": "key k1"}], "answer": "v?", "tools": []}
    samples, prompt_ids, _ = r.run([with_tool, without], sampling_for(spec, 0, 0, 2))
    assert "Tools: lookup(key)" in tok.decode(prompt_ids[0]) and "Tools:" not in tok.decode(prompt_ids[1])
    # the prompt without tools calls one anyway: the model reads an unknown-tool error
    assert samples[2].trajectory.outcomes[0].error == "unknown_tool"
    with pytest.raises(UserError) as e:
        r.run([{**with_tool, "tools": ["search"]}], sampling_for(spec, 0, 0, 1))
    assert_clear(str(e.value), "'search'", "agent.tools")


def test_sft_renders_a_rows_tools_as_the_rollouts_prompt(tok):
    from rlhf.agent.builtin_tools import load_tools
    from rlhf.agent.trajectory import ChatRenderer
    from rlhf.data.agent_tasks import rows
    from rlhf.data.sft import conversation_segments, encode_segments

    row = rows("agent-lookup-sft", "train")[0]
    ids, mask = encode_segments(tok, conversation_segments(tok, row["messages"], "row 0", row["tools"]))
    prompt = ChatRenderer(tok, [t.schema() for t in load_tools(["builtin:lookup"])]).prompt_ids(row["messages"][:1])
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and mask[len(prompt)] == 1


@pytest.mark.parametrize("override, parts", [
    (["agent.parser=xml"], ["agent.parser='xml'", "hermes"]),
    (["agent.tools=[nocolon]"], ["agent.tools[0]='nocolon'", "module:function"]),
    (["agent.tools=[builtin:shell]"], ["builtin:shell", "builtin:python"]),
    (["agent.limits.max_turns=0"], ["agent.limits.max_turns=0", ">= 1"]),
    (["agent.sandbox.isolation=docker"], ["agent.sandbox.isolation='docker'", "bwrap"]),
    (["env.fn=rlhf.envs.keymap:KeymapChain"], ["env.fn", "agent.enabled=false"]),
    (["algo.async_steps=1"], ["agent.enabled=true with algo.async_steps", "algo.async_steps=0"]),
])
def test_bad_agent_settings_are_one_line_each(override, parts, tmp_path, rlhf_cache):
    from rlhf.spec.errors import SpecError

    with pytest.raises(SpecError) as e:
        make_spec(BASE + override, tmp_path / "x")
    line = next(x for x in str(e.value).splitlines() if parts[0] in x)
    assert_clear(line, *parts)
