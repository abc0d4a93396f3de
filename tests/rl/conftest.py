"""What only the RL tests share: the bar a run of the defaults must reach (the session's Ray and
cache are tests/conftest.py's ``rl_env``; running a config is ``tests.helpers.run_rl``)."""

from __future__ import annotations

from typing import Optional

# The built-in task: random responses score about 0.05, the best constant answer 0.34, the optimum 1.
# With its defaults every RL algorithm ends at 0.96-0.99 (mean of the last 5 of 120 steps, seeds 0-2;
# docs/algorithms.md), so a run ending below LEARNED has stopped learning.
LEARNED = 0.8
RANDOM = 0.2  # the first 5 steps score below this: the reward is learned, not there from the start


def assert_learned(algo: str, code: int, rows: list[dict], steps: Optional[int] = None) -> None:
    """A run of the defaults (or of ``steps`` steps) finished every step, began near random and
    ended at >= LEARNED."""
    from rlhf.cli import compose
    from tests.helpers import record_learning

    assert code == 0
    assert len(rows) == (steps or compose([]).train.steps)
    reward = [r["reward/mean"] for r in rows]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    print(f"{algo}: reward {first:.3f} (steps 1-5) -> {last:.3f} (last 5 of {len(rows)})")
    record_learning(f"rl/{algo}", "reward, last 5 steps", last, LEARNED)
    assert first < RANDOM, (algo, first)
    assert last >= LEARNED, (algo, first, last)
