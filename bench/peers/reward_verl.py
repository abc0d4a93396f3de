"""veRL's custom reward function (``reward.custom_reward_function``): the bench's reward,
``bench.rewards.letters``, one response at a time (veRL calls it per sample)."""

from __future__ import annotations

from bench.rewards import letters


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return float(letters([""], [solution_str])[0])
