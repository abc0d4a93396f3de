"""Rewards for math-style prompts with a numeric answer: ``arith_reward`` (``rlhf.data.arith``'s
answers are the number) and ``gsm8k_reward`` (GSM8K's answers are a worked solution ending in
``#### <number>``)."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str):
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def arith_reward(prompts: list[str], responses: list[str], answer: list[str], **metadata) -> list[float]:
    """1.0 when the last number in the response equals the answer, else 0.0."""
    out = []
    for r, a in zip(responses, answer):
        n = last_number(r)
        try:
            out.append(1.0 if n is not None and float(n) == float(a) else 0.0)
        except ValueError:
            out.append(0.0)
    return out


def gsm8k_reward(prompts: list[str], responses: list[str], answer: list[str], **metadata) -> list[float]:
    """1.0 when the last number in the response equals the number after the answer's ``####``."""
    finals = [a.split("####")[-1].strip().replace(",", "") for a in answer]
    return arith_reward(prompts, responses, finals)
