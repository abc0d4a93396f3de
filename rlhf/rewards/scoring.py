"""The samples of a step to scores: decoded, scored by the weighted reward functions (with the
rows' other columns as metadata), plus the reward model's score."""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.data.batch import collate, dp_forward
from rlhf.launch.group import ActorGroup
from rlhf.rewards.loader import Rewards
from rlhf.rollout.engine import Sample
from rlhf.spec.runspec import RunSpec
from rlhf.workers.frozen import RewardModelWorker


def score_samples(spec: RunSpec, rows: list[dict], samples: list[Sample], tokenizer, rewards: Rewards,
                  reward_model: Optional[ActorGroup], prompt_ids: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """Scores ``[len(samples)]``: the weighted reward functions on the decoded texts (with the rows'
    other columns as metadata) plus ``reward.model_weight`` × the reward model (``reward_model``,
    the cluster's group, None without one); and each part."""
    prompts = [tokenizer.decode(prompt_ids[s.prompt_index], skip_special_tokens=True) for s in samples]
    responses = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    keys = [k for k in rows[0] if k != spec.data.prompt_key]
    metadata = {k: [rows[s.prompt_index].get(k) for s in samples] for k in keys}
    metadata["finish_reasons"] = [s.finish_reason for s in samples]
    total, parts = rewards.score(prompts, responses, metadata) if rewards.functions else ([0.0] * len(samples), {})
    scores = torch.tensor(total, dtype=torch.float32)
    if reward_model is not None:
        batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                        tokenizer.pad_token_id, spec.rollout.max_response_tokens)
        rm = dp_forward(reward_model, RewardModelWorker.scores, batch)
        parts["model"] = rm.tolist()
        scores = scores + spec.reward.model_weight * rm
    return scores, parts
