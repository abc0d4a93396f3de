"""Rewards: user functions named in the config, combined with weights, and a reward model.

A reward function has the signature

    fn(prompts: list[str], responses: list[str], **metadata) -> list[float]

``prompts``/``responses`` are decoded text (special tokens removed), one entry per sample;
``metadata`` holds every other column of the prompt's data row as a list aligned with the samples
(e.g. ``answer=[...]``), plus ``finish_reasons`` ("stop" | "length"). Take ``**metadata`` so new
columns do not break the function. Named as ``module:function`` (importable) or
``path/to/file.py:function``; only what the config names is loaded. The user's run in a process
of their own (``rlhf.rewards.isolated``), the project's own (``rlhf.*`` modules) in the driver
(``reward.isolate``: auto; true or false puts every one in the process or the driver), called
once per step with all of its samples (``rlhf.rewards.loader.score_samples``).
"""

from rlhf.rewards.loader import RewardError, RewardFunction, Rewards, load_function, score_samples

__all__ = ["RewardError", "RewardFunction", "Rewards", "load_function", "score_samples"]
