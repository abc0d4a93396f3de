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
    P = max(len(p) for p in prompts)
    R = response_width or max(1, max(len(r) for r in responses))
    prompt_ids, prompt_mask = padded_rows(prompts, P, pad_id, left=True)
    response_ids, response_mask = padded_rows(responses, R, pad_id, left=False)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
            "response_mask": response_mask.to(torch.float32)}


def padded_rows(rows: Sequence[Sequence[Any]], width: int, pad_id: Any, left: bool,
                dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists (or per-token values: ``dtype``) as one ``[len(rows), width]`` tensor and
    its mask (bool, True on a token): each row right-aligned (``left`` padding, as prompts are; a row longer than ``width``
    is an error) or left-aligned and cut to its first ``width`` tokens (responses). The ids are
    copied in once, through the mask, rather than row by row: on the small batches of an RL step a
    copy per row costs more than the tokens themselves."""
    lengths = [len(r) for r in rows]
    if left and lengths and max(lengths) > width:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit width {width} when left-padded")
    if not left:
        rows = [r if n <= width else r[:width] for r, n in zip(rows, lengths)]
        lengths = [min(n, width) for n in lengths]
    n = torch.tensor(lengths, dtype=torch.long).reshape(-1, 1)
    cols = torch.arange(width)
    mask = cols >= width - n if left else cols < n
    ids = torch.full((len(rows), width), pad_id, dtype=dtype)
    # row-major order of the mask's True entries is the rows' tokens one row after another
    ids[mask] = torch.tensor([t for r in rows for t in r], dtype=dtype)
    return ids, mask


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
