"""The reward of the built-in task ``keymap`` (``rlhf.data.builtin``: the table, prompts and rows)."""

from __future__ import annotations

STOP_CREDIT = 0.25


def score(response: str, answer: str) -> float:
    """(1 - STOP_CREDIT) × the fraction of answer positions with the right value, plus STOP_CREDIT
    when the response stops right after the answer's length (EOS). In [0, 1]; only the exact
    answer followed by EOS scores 1."""
    got, want = response.split(), answer.split()
    matched = sum(1 for g, w in zip(got, want) if g == w) / len(want)
    return (1.0 - STOP_CREDIT) * matched + (STOP_CREDIT if len(got) == len(want) else 0.0)


def keymap_reward(prompts: list[str], responses: list[str], answer: list[str], **metadata) -> list[float]:
    """1.0 when the response is the prompt's mapped values and stops; partial credit per value."""
    return [score(r, a) for r, a in zip(responses, answer)]
