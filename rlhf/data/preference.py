"""Preference pairs: rows → (prompt ids, chosen ids, rejected ids); batches for DPO and reward models;
KTO's unpaired examples (``Unpaired``: a completion labelled desirable or not) batched the same way.

A row holds ``data.chosen_key`` and ``data.rejected_key`` and usually ``data.prompt_key``:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                      text
    {"prompt": [msgs], "chosen": [assistant msgs], "rejected": [...]}         conversations
    {"chosen": [full conversation], "rejected": [full conversation]}          no prompt key: the
                                                                              shared first turns are the prompt

Responses are tokenised exactly as SFT does (``rlhf.data.sft.prompt_ids`` / ``response_ids``).

Truncation to ``max_length`` (``data.truncation``): ``right`` cuts the responses' ends, ``left``
cuts the prompt's start (then the responses' ends if the prompt alone is not enough), ``drop``
skips the pair; the prompt is never cut below one token.

A batch of m pairs has 2m sequences: sequence 2i is pair i's chosen, 2i+1 its rejected. Unpacked,
each sequence is one row; packed (``algo.packing``), sequences share rows of up to ``max_length``
tokens. ``seq`` maps every token to its sequence (-1: padding) so per-sequence sums and last-token
scores come out the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rlhf.data.files import Records, check_messages, row_value
from rlhf.data.sft import (Row, TruncationReport, first_fit, keep_within, padding_free_index, prompt_ids,
                           response_ids, scored_index, truncation_policy)
from rlhf.spec.schema import DataSpec
from rlhf.spec.errors import UserError


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def responses(self) -> tuple[list[int], list[int]]:
        """The unit's two sequences' responses, in batch order (``collate_pairs``)."""
        return self.chosen, self.rejected


@dataclass
class Unpaired:
    """One KTO example: a completion marked desirable or not, and ``kl_completion``, another row's
    completion under this prompt (KTO's mismatched pair, whose log-ratio estimates the reference
    point z0). In a batch its sequences are the completion (2i) and the mismatched one (2i+1)."""

    prompt: list[int]
    completion: list[int]
    desirable: bool
    kl_completion: list[int] = field(default_factory=list)

    def responses(self) -> tuple[list[int], list[int]]:
        return self.completion, self.kl_completion


def _split_conversations(rec: Records, i: int, chosen: list, rejected: list) -> tuple[list, list, list]:
    where = rec.where(i)
    check_messages(chosen, where=f"{where}: chosen")
    check_messages(rejected, where=f"{where}: rejected")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and chosen[k - 1]["role"] == "assistant":  # the prompt ends before the reply
        k -= 1
    if k == 0 or chosen[k]["role"] != "assistant" or rejected[k]["role"] != "assistant":
        raise UserError(
            f"{where}: without a prompt key, chosen and rejected must be conversations that share their first "
            "turns and differ in the assistant's reply. Add a prompt column (data.prompt_key) instead."
        )
    return chosen[:k], chosen[k:], rejected[k:]


def pair_from_row(rec: Records, i: int, tokenizer: Any, data: DataSpec) -> Pair:
    row = rec.rows[i]
    where = rec.where(i)
    chosen = row_value(rec, i, data.chosen_key, spec_key="chosen_key", kinds=("text", "messages"))
    rejected = row_value(rec, i, data.rejected_key, spec_key="rejected_key", kinds=("text", "messages"))
    if data.prompt_key in row:
        prompt = row_value(rec, i, data.prompt_key, spec_key="prompt_key", kinds=("text", "messages"))
    elif isinstance(chosen, list) and isinstance(rejected, list):
        prompt, chosen, rejected = _split_conversations(rec, i, chosen, rejected)
    else:
        row_value(rec, i, data.prompt_key, spec_key="prompt_key")  # raises: names the missing key
        raise AssertionError
    p = prompt_ids(tokenizer, prompt, chat_template=data.chat_template, where=where)
    c = response_ids(tokenizer, prompt, chosen, chat_template=data.chat_template, where=f"{where}: chosen")
    r = response_ids(tokenizer, prompt, rejected, chat_template=data.chat_template, where=f"{where}: rejected")
    if c == r:
        raise UserError(f"{where}: chosen and rejected are the same response. Remove the row.")
    return Pair(p, c, r)


def _cut_prompt(prompt: list[int], longest: int, max_length: int, policy: str) -> list[int]:
    """The prompt of a unit ``longest`` tokens long (prompt + its longest response) cut for
    ``max_length``: left drops its first tokens (keeping one); right keeps the last half of a prompt
    that would leave the responses no room (the responses are then cut at their end)."""
    if policy == "left":
        keep = max(len(prompt) - (longest - max_length), 1)
        return prompt[len(prompt) - keep :]
    if len(prompt) >= max_length:  # right: the responses need at least one token of room
        return prompt[len(prompt) - max_length // 2 :]
    return prompt


def truncate_pair(pair: Pair, max_length: int, policy: str) -> tuple[Optional[Pair], int]:
    longest = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
    if longest <= max_length:
        return pair, 0
    if policy == "drop" or max_length < 2:
        return None, longest
    prompt = _cut_prompt(pair.prompt, longest, max_length, policy)
    room = max_length - len(prompt)
    out = Pair(prompt, pair.chosen[:room], pair.rejected[:room])
    if out.chosen == out.rejected:  # the difference was cut away
        return None, longest
    return out, longest - max_length


def build_pairs(rec: Records, tokenizer: Any, data: DataSpec, max_length: int, what: str = "preference") -> tuple[list[Pair], TruncationReport]:
    policy = truncation_policy(data)
    report = TruncationReport(what=what, max_length=max_length, policy=policy)
    out = keep_within((pair_from_row(rec, i, tokenizer, data) for i in range(len(rec))),
                      lambda p: len(p.prompt) + max(len(p.chosen), len(p.rejected)),
                      lambda p: truncate_pair(p, max_length, policy), report, "pair")
    return out, report


def is_paired(rec: Records, data: DataSpec) -> bool:
    """Whether the rows are chosen/rejected pairs (else unpaired completions with a label), read from
    the first row."""
    return bool(len(rec)) and data.chosen_key in rec.rows[0] and data.rejected_key in rec.rows[0]


def unpaired_from_row(rec: Records, i: int, tokenizer: Any, data: DataSpec) -> list[Unpaired]:
    """A row's KTO examples: a pair gives two (chosen desirable, rejected not: TRL's unpairing of
    paired data), an unpaired row ``{prompt, <data.response_key>, <data.label_key>: bool}`` one."""
    row = rec.rows[i]
    where = rec.where(i)
    if data.chosen_key in row and data.rejected_key in row:
        pair = pair_from_row(rec, i, tokenizer, data)
        return [Unpaired(pair.prompt, pair.chosen, True), Unpaired(pair.prompt, pair.rejected, False)]
    prompt = row_value(rec, i, data.prompt_key, spec_key="prompt_key", kinds=("text", "messages"))
    completion = row_value(rec, i, data.response_key, spec_key="response_key", kinds=("text", "messages"))
    label = row.get(data.label_key)
    if not isinstance(label, bool):
        raise UserError(f"{where}: {data.label_key!r} must be true (a desirable completion) or false (undesirable), "
                        f"got {label!r}. Set data.label_key=<the key of that boolean>, or give chosen/rejected "
                        "pairs (data.chosen_key, data.rejected_key).")
    p = prompt_ids(tokenizer, prompt, chat_template=data.chat_template, where=where)
    c = response_ids(tokenizer, prompt, completion, chat_template=data.chat_template, where=f"{where}: completion")
    return [Unpaired(p, c, label)]


def truncate_unpaired(ex: Unpaired, max_length: int, policy: str) -> tuple[Optional[Unpaired], int]:
    longest = len(ex.prompt) + len(ex.completion)
    if longest <= max_length:
        return ex, 0
    if policy == "drop" or max_length < 2:
        return None, longest
    prompt = _cut_prompt(ex.prompt, longest, max_length, policy)
    return Unpaired(prompt, ex.completion[:max_length - len(prompt)], ex.desirable), longest - max_length


def build_unpaired(rec: Records, tokenizer: Any, data: DataSpec, max_length: int, what: str = "kto",
                   seed: int = 0) -> tuple[list[Unpaired], TruncationReport]:
    """KTO's examples, each with its mismatched completion: example i of a seeded permutation takes
    the completion of the next one (cut to fit ``max_length``), fixed for the run, so the reference's
    log-probs of it are computed once with the others'."""
    policy = truncation_policy(data)
    report = TruncationReport(what=what, max_length=max_length, policy=policy)
    out = keep_within((ex for i in range(len(rec)) for ex in unpaired_from_row(rec, i, tokenizer, data)),
                      lambda e: len(e.prompt) + len(e.completion),
                      lambda e: truncate_unpaired(e, max_length, policy), report, "example")
    if len(out) < 2:
        raise UserError(f"{what}: KTO needs at least 2 examples (one's completion is another's mismatched pair).")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(out), generator=g).tolist()
    for k, i in enumerate(order):
        other = out[order[(k + 1) % len(order)]].completion
        out[i].kl_completion = other[:max(max_length - len(out[i].prompt), 1)]
    return out, report


def collate_pairs(pairs: Sequence[Pair], pad_id: int, *, pack: bool = False, max_length: int = 0) -> dict[str, Any]:
    """Tensors for m pairs: input_ids, loss_mask (response tokens), position_ids, seg (example
    number within its row, -1 padding), seq (sequence number 0..2m-1, -1 padding), ``last``
    [2m, 2] = (row, position) of each sequence's last token, the real tokens' places
    (``rlhf.data.sft.padding_free_index``) and the response tokens' (``scored_index``: where
    ``sequence_logps`` sums)."""
    seqs: list[tuple[list[int], list[int]]] = []
    for p in pairs:
        for resp in p.responses():
            seqs.append((p.prompt + resp, [0] * len(p.prompt) + [1] * len(resp)))
    lengths = [len(s[0]) for s in seqs]
    bins = first_fit(lengths, max(max_length, max(lengths))) if pack else [[k] for k in range(len(seqs))]
    rows: list[Row] = []
    seq_of_row: list[list[int]] = []
    for b in bins:
        r = Row()
        ids: list[int] = []
        for k, s in enumerate(b):
            r.add(seqs[s][0], seqs[s][1], k)
            ids.extend([s] * lengths[s])
        rows.append(r)
        seq_of_row.append(ids)
    T = max(len(r) for r in rows)
    B = len(rows)
    out = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((B, T), dtype=torch.long),
        "position_ids": torch.zeros((B, T), dtype=torch.long),
        "seg": torch.full((B, T), -1, dtype=torch.long),
        "seq": torch.full((B, T), -1, dtype=torch.long),
    }
    last = torch.zeros((len(seqs), 2), dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r)
        out["input_ids"][b, :n] = torch.tensor(r.input_ids)
        out["loss_mask"][b, :n] = torch.tensor(r.loss_mask)
        out["position_ids"][b, :n] = torch.tensor(r.position_ids)
        out["seg"][b, :n] = torch.tensor(r.seg)
        out["seq"][b, :n] = torch.tensor(seq_of_row[b])
        for t in range(n):
            last[seq_of_row[b][t]] = torch.tensor([b, t])
    out["last"] = last
    out["response_tokens"] = torch.tensor([sum(s[1]) for s in seqs], dtype=torch.long)  # per sequence
    if pairs and isinstance(pairs[0], Unpaired):
        out["desirable"] = torch.tensor([p.desirable for p in pairs], dtype=torch.bool)
    out.update(padding_free_index(out["seg"], out["position_ids"]))
    out["scored_index"] = scored_index(summed_positions(out))
    return out


def summed_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` bool: the positions whose log-probs ``sequence_logps`` sums."""
    return batch["loss_mask"].bool() & (batch["seq"] >= 0)


def sequence_logps(token_logp: torch.Tensor, batch: dict[str, torch.Tensor], n_seqs: int) -> torch.Tensor:
    """Sum of response-token log-probs per sequence, ``[n_seqs]``.

    ``token_logp [B, T]`` holds at position t the log-prob of ``input_ids[:, t]`` (position 0,
    which nothing predicts, may hold anything: it is a prompt token). A batch of ``collate_pairs``
    carries those positions as ``scored_index`` (position 0 is never a response token there):
    picked by index, so the device reports no count to the host as a boolean mask would."""
    sums = torch.zeros(n_seqs, dtype=token_logp.dtype, device=token_logp.device)
    at = batch.get("scored_index")
    if at is not None:
        return sums.index_add(0, batch["seq"].flatten().index_select(0, at), token_logp.flatten().index_select(0, at))
    keep = summed_positions(batch)
    return sums.index_add(0, batch["seq"][keep], token_logp[keep])


def last_token_values(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``values [B, T]`` (a per-token score) at each sequence's last token → ``[n_seqs]``."""
    last = batch["last"].to(values.device)
    return values[last[:, 0], last[:, 1]]
