"""The multi-turn rollout: model turns from the rollout engines, feedback from environments.

Turn 1 samples ``group_size`` responses per prompt (the same seeds as single-turn sampling). Each
trajectory then alternates: environment step on the decoded turn → feedback ids appended (mask 0,
log-prob 0) → one more sample from the engine on ``prompt + trajectory`` (mask 1, the engine's
log-probs), until the environment says done or ``env.max_turns`` model turns have been taken.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.launch.cluster import Cluster
from rlhf.rollout.engine import Sample
from rlhf.rollout.generate import generate, sampling_for
from rlhf.spec.runspec import RunSpec


@dataclass
class EnvSample(Sample):
    loss_mask: list[int] = field(default_factory=list)  # 1: a model token, 0: environment feedback
    turns: int = 0


def env_rollout(spec: RunSpec, step: int, rows: list[dict], prompt_ids: list[list[int]], tokenizer, cluster: Cluster,
                first_turn: list[Sample]) -> tuple[list[EnvSample], torch.Tensor, dict, dict]:
    """(trajectories, episode rewards, reward parts, env metrics) of one step's prompts."""
    from rlhf.envs import load_env

    cls = load_env(spec.env.fn)
    N = len(first_turn)
    envs = []
    for s in first_turn:
        env = cls()
        env.reset(dict(rows[s.prompt_index]))
        envs.append(env)
    ids: list[list[int]] = [[] for _ in range(N)]
    logp: list[list[float]] = [[] for _ in range(N)]
    mask: list[list[int]] = [[] for _ in range(N)]
    rewards: list[list[float]] = [[] for _ in range(N)]
    finish = ["length"] * N
    active = list(range(N))
    outs = first_turn
    feedback_tokens = 0
    for turn in range(spec.env.max_turns):
        nxt = []
        for i, s in zip(active, outs):
            ids[i] += s.response_ids
            logp[i] += s.logprobs
            mask[i] += [1] * len(s.response_ids)
            finish[i] = s.finish_reason
            feedback, r, done = envs[i].step(tokenizer.decode(s.response_ids, skip_special_tokens=True))
            rewards[i].append(float(r))
            if done or feedback is None or turn == spec.env.max_turns - 1:
                continue
            fb = tokenizer(feedback, add_special_tokens=False)["input_ids"]
            ids[i] += fb
            logp[i] += [0.0] * len(fb)
            mask[i] += [0] * len(fb)
            feedback_tokens += len(fb)
            nxt.append(i)
        active = nxt
        if not active:
            break
        base = sampling_for(spec, step, 0, 1)
        # seeded rollouts (HF, or rollout.seeded=true) get a seed per request and turn; vLLM's
        # default is unseeded requests (rlhf.plan.auto), and then none here either
        seeds = tuple(base.seeds[0] * 31 + (turn + 1) * 1_000_033 + i for i in active) if base.seeds else ()
        sampling = dataclasses.replace(base, n=1, seeds=seeds)
        outs = generate(cluster.rollout.workers, [prompt_ids[first_turn[i].prompt_index] + ids[i] for i in active],
                        sampling)
    samples = [EnvSample(response_ids=ids[i], logprobs=logp[i], finish_reason=finish[i],
                         prompt_index=first_turn[i].prompt_index, loss_mask=mask[i], turns=len(rewards[i]))
               for i in range(N)]
    episode = [sum(r) / len(r) for r in rewards]
    scores = torch.tensor(episode, dtype=torch.float32)
    turns = [len(r) for r in rewards]
    stats = {
        "env/turns_mean": sum(turns) / max(N, 1),
        "env/feedback_tokens_mean": feedback_tokens / max(N, 1),
        "env/first_turn_reward": sum(r[0] for r in rewards) / max(N, 1),
        "env/last_turn_reward": sum(r[-1] for r in rewards) / max(N, 1),
    }
    return samples, scores, {"env": episode}, stats


def env_loss_mask(samples: list[Sample], width: int) -> torch.Tensor:
    """[B, width] 1 where a response position is a model token (or padding), 0 on feedback."""
    out = torch.ones(len(samples), width)
    for b, s in enumerate(samples):
        m = getattr(s, "loss_mask", None)
        if m:
            m = m[:width]
            out[b, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return out
