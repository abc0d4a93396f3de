"""How many tokens one training pass holds: what the memory plan sizes the activations by.

RL passes pack samples (a prompt and its response) up to ``train.max_tokens_per_micro_batch``.
sft/rm/dpo passes take ``train.micro_batch_size`` units of up to ``data.max_length`` tokens per
sequence (None: the rollout's prompt + response budget), a unit being an example, or with ``algo.packing`` a
row of examples filled up to that length (sft), or a pair, chosen and rejected (rm, dpo). They do
not read the token budget, so the plan's budget for them is that product, the most one of their
micro-batches holds.

Functions of the config sections, so validation (before the spec exists) and the built spec agree.
"""

from __future__ import annotations

from typing import Any

PAIRED = ("rm", "dpo")  # a unit is two sequences


def sequence_tokens(algo: Any, data: Any, rollout: Any) -> int:
    """The longest sequence a training pass sees."""
    budget = rollout.max_prompt_tokens + rollout.max_response_tokens
    if algo.kind == "rl":
        return budget
    return data.max_length or budget


def sequences_per_unit(algo: Any) -> int:
    return 2 if algo.kind in PAIRED else 1


def micro_batch_tokens(algo: Any, micro_batch_size: int, data: Any, rollout: Any) -> tuple[int, str]:
    """(The most tokens one micro-batch holds, how it is made up) for the plan: RL's default budget
    (``train.max_tokens_per_micro_batch`` null), sft/rm/dpo's only one."""
    seq, per, m = sequence_tokens(algo, data, rollout), sequences_per_unit(algo), micro_batch_size
    if algo.kind == "rl":
        return m * seq, f"{m} samples × {seq} tokens"
    where = "data.max_length" if data.max_length else "rollout.max_prompt_tokens + rollout.max_response_tokens"
    unit = (f"{m} pairs × 2 sequences" if per == 2 else f"{m} packed rows" if getattr(algo, "packing", False)
            else f"{m} examples")
    return m * per * seq, f"{unit} × {seq} tokens ({where})"
