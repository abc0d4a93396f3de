"""Multi-turn environments: the policy and an environment take turns on one token trajectory.

An environment is a class named in the config (``env.fn=module:Class`` or ``path/to/file.py:Class``),
constructed with no arguments, once per trajectory:

    env.reset(row: dict) -> None
        the prompt's data row (``prompt`` and every other column, e.g. ``answer``)
    env.step(response: str) -> (feedback: str | None, reward: float, done: bool)
        the model's latest turn (decoded, special tokens removed); the text the environment answers
        with (appended to the trajectory, then the model speaks again), that turn's reward, and
        whether the episode is over

The rollout (``rlhf.envs.rollout``) runs up to ``env.max_turns`` model turns. It keeps the ids the
engine sampled and appends the tokenised feedback, so training sees exactly the sampled tokens
(no re-tokenisation of model turns); feedback tokens get ``response_mask`` 0 (no loss, no
advantage, no KL). The episode's reward is the mean of its turns' rewards; reward functions and a
reward model are not used with an environment.
"""

from __future__ import annotations

from typing import Optional, Protocol


class Env(Protocol):
    def reset(self, row: dict) -> None: ...

    def step(self, response: str) -> tuple[Optional[str], float, bool]: ...


def load_env(ref: str) -> type:
    """``module:Class`` or ``file.py:Class`` -> the class (UserError otherwise)."""
    from rlhf.rewards.loader import load_function

    return load_function(ref)  # same resolution and messages as reward functions: any callable


__all__ = ["Env", "load_env"]
