"""Padding-free micro-batches for the RL passes (log-probs, values, the update).

A padded batch (``rlhf.data.batch``) keeps every row at width P + R. Here the real tokens of
several rows are laid end to end in ONE row, each sample restarting its position ids at 0, and
the attention stays inside each sample (``cu_seqlens``, as in FlashAttention's varlen kernels):

    input_ids     [1, L]   the samples' real tokens, one after another (L = their sum)
    position_ids  [1, L]   0 … n_i - 1 for each sample i
    cu_seqlens    [n + 1]  int32, where each sample starts (and the last one ends)
    pred_index    [M]      the positions whose hidden state predicts a response token
    targets       [M]      those response tokens
    rows, cols    [M]      where each predicted token sits in the padded ``[B, R]`` layout

so per-token tensors of the padded batch (advantages, old log-probs, masks) are read at
``[rows, cols]`` and results scattered back there (``unpack``). Micro-batches are cut by a token
budget (``token_groups``) instead of a row count, and every data-parallel rank must run the same
number of them (DeepSpeed reduces gradients in step): ``split_to_count`` evens them out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhf.data.batch import Batch

Packed = dict[str, torch.Tensor]

# per-token tensors of the padded batch that the update reads
TOKEN_KEYS = ("response_mask", "advantages", "returns", "old_logp", "ref_logp", "rollout_logp", "old_values")


def real_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Real prompt and response tokens of every row: ``(prompt_len [B], response_len [B])``."""
    R = batch["response_mask"].shape[1]
    attn = batch["attention_mask"]
    return attn[:, :-R].sum(-1), attn[:, -R:].sum(-1)


def token_groups(n_tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive rows into groups of at most ``budget`` tokens (a row longer than the budget
    gets a group of its own). Order is kept, so results do not depend on the budget."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(n_tokens):
        if groups and used + n <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


def split_to_count(groups: list[list[int]], n_tokens: Sequence[int], count: int) -> list[list[int]]:
    """Split the largest groups in two until there are ``count`` groups; a group of one row cannot
    be split, so the result may be padded with empty groups (a rank with less work runs empty
    micro-batches that add nothing to the gradient)."""
    out = [list(g) for g in groups]
    while len(out) < count:
        splittable = [i for i, g in enumerate(out) if len(g) > 1]
        if not splittable:
            out.extend([] for _ in range(count - len(out)))
            break
        i = max(splittable, key=lambda j: sum(n_tokens[r] for r in out[j]))
        g = out[i]
        total = sum(n_tokens[r] for r in g)
        acc, cuts = 0, []
        for k, r in enumerate(g[:-1]):  # the cut that leaves the larger part smallest
            acc += n_tokens[r]
            cuts.append((max(acc, total - acc), k + 1))
        half = min(cuts)[1]
        out[i:i + 1] = [g[:half], g[half:]]
    return out


def largest_first(groups: list[list[int]], n_tokens: Sequence[int]) -> list[list[int]]:
    """``groups`` reordered by their token count, largest first (ties keep their order).

    Why: PyTorch's caching allocator reuses a freed block only for a tensor that fits in it. When a
    micro-batch is even a few tokens longer than the one before, every activation tensor it saves
    is too large for the blocks the previous one freed, and the allocator reserves new segments
    on top of them; the largest first makes every later micro-batch fit the cached blocks."""
    return sorted(groups, key=lambda g: -sum(n_tokens[r] for r in g))


def pack(batch: Batch, rows: Sequence[int]) -> Packed:
    """The rows ``rows`` of a padded batch as one padding-free sequence (see the module doc).
    Every row needs at least one prompt token (the position that predicts the first response
    token). An empty ``rows`` gives a one-token stand-in whose ``pred_index`` is empty."""
    ids = batch["input_ids"]
    R = batch["response_mask"].shape[1]
    T = ids.shape[1]
    P = T - R
    plen, rlen = real_lengths(batch)
    if not len(rows):
        return {"input_ids": ids[:1, -1:].clone() * 0, "position_ids": torch.zeros(1, 1, dtype=torch.long),
                "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32), "max_len": torch.tensor(1),
                "pred_index": torch.zeros(0, dtype=torch.long), "targets": torch.zeros(0, dtype=torch.long),
                "rows": torch.zeros(0, dtype=torch.long), "cols": torch.zeros(0, dtype=torch.long),
                "sq_lengths": torch.tensor(0.0)}
    # every row's real tokens sit at columns P - p ... P + r - 1: one mask picks them all, in row order
    index = torch.as_tensor(list(rows), dtype=torch.long, device=ids.device)
    p, r = plen[index], rlen[index]
    if bool((p < 1).any()):
        raise ValueError(f"row {int(index[p < 1][0])} has no prompt token: nothing predicts its first response token")
    n = p + r
    ends = n.cumsum(0)
    starts = ends - n
    sub = ids[index]
    dev = ids.device
    real = (torch.arange(T, device=dev) >= P - p[:, None]) & (torch.arange(T, device=dev) < P + r[:, None])
    in_response = torch.arange(R, device=dev) < r[:, None]
    cols = torch.arange(R, device=dev).expand(len(index), R)[in_response]  # 0 … r_i - 1 for each row i
    lengths = n.to(torch.float64)
    return {
        "input_ids": sub[real].unsqueeze(0),
        "position_ids": (torch.arange(int(ends[-1]), device=dev) - starts.repeat_interleave(n)).unsqueeze(0),
        "cu_seqlens": torch.cat([ends.new_zeros(1), ends]).to(torch.int32),
        "max_len": torch.tensor(int(n.max())),
        "pred_index": (starts + p - 1).repeat_interleave(r) + cols,
        "targets": sub[:, P:][in_response],
        "rows": torch.arange(len(index), device=dev).repeat_interleave(r),
        "cols": cols,
        "sq_lengths": (lengths ** 2).sum(),  # for the attention FLOP count
    }


def token_values(batch: Batch, rows: Sequence[int], packed: Packed, keys: Sequence[str] = TOKEN_KEYS) -> Packed:
    """The per-token tensors ``keys`` of the padded batch at the packed tokens, flat ``[M]``."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    out = {}
    for k in keys:
        if k in batch:
            out[k] = batch[k][index][packed["rows"], packed["cols"]] if len(index) else batch[k][:0, 0]
    return out


def unpack(flat: torch.Tensor, packed: Packed, n_rows: int, width: int) -> torch.Tensor:
    """Flat per-token values ``[M]`` back to the padded layout ``[n_rows, width]`` (0 elsewhere)."""
    out = torch.zeros(n_rows, width, dtype=flat.dtype, device=flat.device)
    out[packed["rows"].to(flat.device), packed["cols"].to(flat.device)] = flat
    return out
