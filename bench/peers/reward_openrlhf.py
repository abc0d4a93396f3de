"""OpenRLHF's reward file (``--reward.remote_url <this file>``): ``reward_func(queries, prompts,
labels)`` with ``queries`` = prompt + response text; the response is scored with the bench's reward
(``bench.rewards.letters``), as on the other sides."""

from __future__ import annotations

import torch

from bench.rewards import letters


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    r = torch.tensor(letters(list(prompts), responses), dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {}}
