"""ZeRO-3's one rule the passes must keep by hand: every rank calls a partitioned module as many
times, since each call gathers its weight from every rank (a collective)."""

from __future__ import annotations

from typing import Optional

import torch


def padded_head(head) -> bool:
    """Whether calls of ``head`` must be matched over ranks: a ZeRO-3 (partitioned) weight with
    more than one rank."""
    import torch.distributed as dist

    return hasattr(getattr(head, "weight", None), "ds_id") and dist.is_initialized() and dist.get_world_size() > 1


def equal_head_rows(hidden: torch.Tensor, tokens: torch.Tensor, head,
                    most: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(hidden, tokens, n)`` for ``rlhf.algos.logprobs_from_hidden``, padded so that every rank
    calls the LM head as many times. A ZeRO-3 head is a partitioned module that gathers its weight at
    each call (one chunk each), and a rank that made fewer calls than another would leave the
    gathers unmatched. So with a ZeRO-3 head over several ranks the rows are padded with zeros to the
    largest count of any rank (a zero row adds nothing to the weight's gradient); ``n`` is this
    rank's own count, the outputs' rows to keep. Otherwise the inputs come back as they are.

    ``most``: that largest count where the caller agreed it beforehand (every rank the same value;
    ``rlhf.workers.model`` does it once for all its micro-batches, the supervised loops' driver in
    each micro-batch, ``rlhf.loops.supervised.agree_head_rows``); without it the ranks agree here,
    a collective and a read of its result on the host at each call."""
    import torch.distributed as dist

    n = hidden.shape[0]
    if not padded_head(head):
        return hidden, tokens, n
    if most is None:
        t = torch.tensor([n], device=hidden.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        most = int(t.item())
    if most < n:
        raise ValueError(f"equal_head_rows: {n} rows on this rank but the agreed largest count is {most}")
    pad = most - n
    if pad == 0:
        return hidden, tokens, n
    return (torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])]),
            torch.cat([tokens, tokens.new_zeros(pad)]), n)
