"""Every RL algorithm learns the built-in task with its defaults (issue 20).

Each run is ``rlhf-run algo=<name>`` as a user types it: the algorithm's conf/algo file and the tiny
model's defaults (120 steps of 32 prompts × 8 samples), only with tracking off. grpo's run is
test_rl_runs.py's module fixture, which other tests there read too.
"""

from __future__ import annotations

import pytest

from tests.rl.conftest import assert_learned, run_rl


@pytest.mark.parametrize("algo", ["ppo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_algo_learns_with_its_defaults(rl_env, tmp_path, algo):
    code, rows = run_rl([f"algo={algo}", "tracking=none"], tmp_path / algo)
    assert_learned(algo, code, rows)
    if algo == "ppo":
        assert all("critic/value_loss" in r and "critic/explained_variance" in r for r in rows)
