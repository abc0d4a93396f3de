"""Multi-turn environments: the keymap chain env learns, feedback tokens carry no loss."""

from __future__ import annotations

import pytest

from tests.helpers import fifth_means, make_spec, record_learning, run_rl

STEPS = 40  # 20 gained 0.081 against the 0.08 asked on one seed (docs/learning-margins.md)
# algo.lr=5e-3: faster than the tiny model's default, so that 40 steps show learning
ENV = ["algo=grpo", "train.prompts_per_step=16", "rollout.max_response_tokens=3", "train.seed=1", "algo.lr=5e-3",
       "env.fn=rlhf.envs.keymap:KeymapChain", "env.max_turns=2",
       "tracking=none"]  # the run's metrics.jsonl is all it reads (the same metrics without a tracker)


def test_keymap_chain_env_learns(rl_env, tmp_path):
    code, rows = run_rl(ENV + [f"train.steps={STEPS}"], tmp_path / "env")
    assert code == 0
    assert len(rows) == STEPS
    assert all(r["env/feedback_tokens_mean"] > 0 for r in rows)  # turns were interleaved with feedback
    assert all(1.0 < r["env/turns_mean"] <= 2.0 for r in rows)
    first, last = fifth_means(rows)
    record_learning("rl/env-keymap-chain", "reward gain, last fifth - first", last - first, 0.08)
    assert last >= first + 0.08, (first, last)


class _Cluster:
    """Stands in for the rollout engines: an HF engine over the tiny model, in-process."""

    def __init__(self, spec):
        from rlhf.models import load_model, load_tokenizer, resolve_model_path
        from rlhf.rollout.hf import HFEngine

        path = resolve_model_path(spec.model.path, spec.model)
        self.tok = load_tokenizer(path)
        model = load_model(path, "causal_lm", "float32", pad_token_id=self.tok.pad_token_id)
        engine = HFEngine(model, self.tok.eos_token_id, self.tok.pad_token_id)

        class W:
            class generate:  # noqa: N801 (mimics a Ray actor method)
                @staticmethod
                def remote(ids, sampling):
                    return engine.generate(ids, sampling)

        self.rollout = type("G", (), {"workers": [W()]})()


def test_feedback_tokens_are_masked(tmp_path, monkeypatch):  # no Ray: an in-process engine
    import ray

    from rlhf.data.batch import collate
    from rlhf.envs.rollout import env_loss_mask, env_rollout
    from rlhf.rollout.generate import sampling_for
    from rlhf.data.prompts import tokenize_prompts

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    spec = make_spec(ENV + ["env.max_turns=3", "algo.group_size=2"], tmp_path / "x")
    cl = _Cluster(spec)
    rows = [{"prompt": "key k3", "answer": "v?"}, {"prompt": "key k5", "answer": "v?"}]
    pids = tokenize_prompts(spec, cl.tok, rows)
    first = cl.rollout.workers[0].generate.remote(pids, sampling_for(spec, 0, 0, len(pids)))
    samples, scores, parts, stats = env_rollout(spec, 0, rows, pids, cl.tok, cl, first)
    assert len(samples) == 4 and scores.shape == (4,)
    key, eos = cl.tok.convert_tokens_to_ids("key"), cl.tok.eos_token_id
    for s in samples:
        assert s.turns == 3
        assert len(s.loss_mask) == len(s.response_ids) == len(s.logprobs)
        # feedback is exactly "key k<j>" (2 tokens, mask 0, log-prob 0) after each of the first 2 turns
        fb = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert len(fb) == 4
        assert [s.response_ids[i] for i in fb[::2]] == [key, key]
        assert all(s.logprobs[i] == 0.0 for i in fb)
        # model tokens are the sampled ones: turn 1 equals the first-turn sample
        t1 = first[samples.index(s)].response_ids
        assert s.response_ids[:len(t1)] == t1 and all(s.loss_mask[:len(t1)])
    batch = collate([pids[s.prompt_index] for s in samples], [s.response_ids for s in samples], cl.tok.pad_token_id)
    mask = batch["response_mask"] * env_loss_mask(samples, batch["response_mask"].shape[1])
    for b, s in enumerate(samples):
        assert mask[b, : len(s.loss_mask)].tolist() == [float(m) for m in s.loss_mask]
    assert float(parts["env"][0]) == pytest.approx(float(scores[0]))


def test_later_turns_sample_unseeded_when_the_run_is_unseeded(tmp_path, monkeypatch):
    """vLLM runs leave requests unseeded by default (rollout.seeded auto; HF generate on CPU needs
    seeds, so the unseeded Sampling is stood in here): the environment's later turns must then ask
    for unseeded samples too, not index a seed that is not there."""
    import dataclasses

    import ray

    from rlhf.envs import rollout as env_mod
    from rlhf.rollout.generate import sampling_for
    from rlhf.data.prompts import tokenize_prompts

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(env_mod, "sampling_for",
                        lambda *a: dataclasses.replace(sampling_for(*a), seeds=()))  # as for vLLM
    spec = make_spec(ENV + ["env.max_turns=2", "algo.group_size=2"], tmp_path / "x")
    cl = _Cluster(spec)
    asked = []
    real = cl.rollout.workers[0].generate.remote
    cl.rollout.workers[0].generate.remote = lambda ids, sampling: asked.append(sampling) or real(ids, sampling)
    rows = [{"prompt": "key k3", "answer": "v?"}]
    pids = tokenize_prompts(spec, cl.tok, rows)
    first = real(pids, dataclasses.replace(sampling_for(spec, 0, 0, len(pids)), seeds=()))
    samples, *_ = env_mod.env_rollout(spec, 0, rows, pids, cl.tok, cl, first)
    assert len(samples) == 2 and asked and all(s.seeds == () for s in asked)
