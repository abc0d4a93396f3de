"""Prompt rows to token ids, and samples to scores: what training, evaluation and async rollouts
do alike around generation."""

from __future__ import annotations

from typing import Any

import torch

from rlhf.data.batch import collate, dp_forward
from rlhf.data.prompts import render_prompt
from rlhf.rollout.engine import Sample
from rlhf.spec.runspec import RunSpec
from rlhf.workers.train import RewardModelWorker


def tokenize_prompts(spec: RunSpec, tokenizer, rows: list[dict]) -> list[list[int]]:
    """Each row's prompt rendered (chat template or plain) and tokenised; an over-long prompt keeps
    its last ``rollout.max_prompt_tokens`` tokens."""
    out = []
    for row in rows:
        text = render_prompt(row, spec.data, tokenizer)
        templated = spec.data.chat_template or isinstance(row[spec.data.prompt_key], list)
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        out.append(ids[-spec.rollout.max_prompt_tokens:])  # keep the end of an over-long prompt
    return out


def score_samples(spec: RunSpec, rows: list[dict], samples: list[Sample], tokenizer, rewards: Any, cluster: Any,
                  prompt_ids: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """Scores ``[len(samples)]``: the weighted reward functions on the decoded texts (with the rows'
    other columns as metadata) plus ``reward.model_weight`` × the reward model; and each part."""
    prompts = [tokenizer.decode(prompt_ids[s.prompt_index], skip_special_tokens=True) for s in samples]
    responses = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    keys = [k for k in rows[0] if k != spec.data.prompt_key]
    metadata = {k: [rows[s.prompt_index].get(k) for s in samples] for k in keys}
    metadata["finish_reasons"] = [s.finish_reason for s in samples]
    total, parts = rewards.score(prompts, responses, metadata) if rewards.functions else ([0.0] * len(samples), {})
    scores = torch.tensor(total, dtype=torch.float32)
    if cluster.reward_model is not None:
        batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                        tokenizer.pad_token_id, spec.rollout.max_response_tokens)
        rm = dp_forward(cluster.reward_model, RewardModelWorker.scores, batch)
        parts["model"] = rm.tolist()
        scores = scores + spec.reward.model_weight * rm
    return scores, parts
