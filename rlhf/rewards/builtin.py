"""Reward functions of the built-in task (see ``rlhf.data.builtin``)."""

from __future__ import annotations

from rlhf.data.builtin import score


def keymap_reward(prompts: list[str], responses: list[str], answer: list[str], **metadata) -> list[float]:
    """1.0 when the response is the prompt's mapped values and stops; partial credit per value."""
    return [score(r, a) for r, a in zip(responses, answer)]
