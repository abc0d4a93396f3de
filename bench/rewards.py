"""Reward functions for the GPU end-to-end runs (random-weight models, so nothing semantic).

``letters``: the fraction of a response's characters that are ASCII letters a-m. It varies from
sample to sample of a random model (so GRPO's group advantages are not all zero) and a policy can
raise it by preferring such tokens.
"""

from __future__ import annotations


def letters(prompts: list[str], responses: list[str], **metadata) -> list[float]:
    out = []
    for r in responses:
        out.append(sum(1 for c in r if "a" <= c <= "m") / max(len(r), 1))
    return out
