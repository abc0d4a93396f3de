"""ZeRO-3's one rule the passes must keep by hand: every rank calls a partitioned module as many
times, since each call gathers its weight from every rank (a collective)."""

from __future__ import annotations

import torch


def equal_head_rows(hidden: torch.Tensor, tokens: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(hidden, tokens, n)`` for ``rlhf.algos.logprobs_from_hidden``, padded so that every rank
    calls the LM head as many times. A ZeRO-3 head is a partitioned module that gathers its weight at
    each call (one chunk each), and a rank that made fewer calls than another would leave the
    gathers unmatched. So with a ZeRO-3 head over several ranks the rows are padded with zeros to the
    largest count of any rank (a zero row adds nothing to the weight's gradient); ``n`` is this
    rank's own count, the outputs' rows to keep. Otherwise the inputs come back as they are."""
    import torch.distributed as dist

    n = hidden.shape[0]
    weight = getattr(head, "weight", None)
    if not (hasattr(weight, "ds_id") and dist.is_initialized() and dist.get_world_size() > 1):
        return hidden, tokens, n
    most = torch.tensor([n], device=hidden.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    pad = int(most.item()) - n
    if pad == 0:
        return hidden, tokens, n
    return (torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])]),
            torch.cat([tokens, tokens.new_zeros(pad)]), n)
