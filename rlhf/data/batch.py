"""The tensor batch that flows between the driver and the workers.

A batch is a plain ``dict[str, Tensor]`` (pickles through Ray cheaply). Every row is one sample:
its prompt left-padded to a common width P, then its response right-padded to a common width R:

    input_ids       [B, P+R] long    prompt | response (pad elsewhere)
    attention_mask  [B, P+R] long    1 on real tokens
    position_ids    [B, P+R] long    cumsum(attention_mask) - 1 (so padding never shifts positions)
    response_mask   [B, R]   float   1 on policy tokens (the response, EOS included)

Per-token tensors over the response part are ``[B, R]`` and aligned with ``response_mask``:
``old_logp``, ``ref_logp``, ``rollout_logp``, ``advantages``, ``returns``, ``old_values``. The
model's logits for response token t are at position ``P - 1 + t`` (see ``response_slice``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

Batch = dict[str, torch.Tensor]


def collate(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
            response_width: int | None = None) -> Batch:
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = response_width or max(1, max(len(r) for r in responses))
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    rmask = torch.zeros((B, R), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        r = list(r)[:R]
        ids[b, P - len(p):P] = torch.as_tensor(list(p), dtype=torch.long)
        attn[b, P - len(p):P] = 1
        if r:
            ids[b, P:P + len(r)] = torch.as_tensor(r, dtype=torch.long)
            attn[b, P:P + len(r)] = 1
            rmask[b, :len(r)] = 1.0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "response_mask": rmask}


def response_width(batch: Batch) -> int:
    return batch["response_mask"].shape[1]


def response_slice(batch: Batch) -> slice:
    """Positions of the logits that predict the response tokens."""
    T = batch["input_ids"].shape[1]
    R = response_width(batch)
    return slice(T - R - 1, T - 1)


def response_tokens(batch: Batch) -> torch.Tensor:
    return batch["input_ids"][:, -response_width(batch):]


def select(batch: Batch, index: torch.Tensor | slice | Sequence[int]) -> Batch:
    """Rows ``index`` of every tensor (the batch dimension is dim 0 everywhere)."""
    if not isinstance(index, (slice, torch.Tensor)):
        index = torch.as_tensor(list(index), dtype=torch.long)
    return {k: v[index] for k, v in batch.items()}


def concat(batches: Sequence[Batch]) -> Batch:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def size(batch: Batch) -> int:
    return batch["input_ids"].shape[0]


def shards(batch: Batch, world: int) -> list[Batch]:
    """Contiguous row shards, one per rank; the last takes the remainder."""
    n = size(batch)
    per = n // world
    return [select(batch, slice(r * per, (r + 1) * per if r < world - 1 else n)) for r in range(world)]


def dp_forward(group: Any, method: Any, batch: Batch) -> torch.Tensor:
    """Split rows over an actor group's ranks, run ``method`` (a worker method, e.g.
    ``ReferenceWorker.logprobs``) on each shard, concatenate."""
    return torch.cat(group.scatter(method, shards(batch, group.world_size)))
