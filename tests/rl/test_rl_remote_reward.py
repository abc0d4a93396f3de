"""Rewards from a reward server (``reward.remote``): a server that does not answer is a user error.
The run scored by a server on localhost is tests/rl/test_rl_runs.py's data-parallel run
(``test_run_with_remote_reward``: the samples scored remotely in batches, the service's part equal to the same
function's run locally), which serves the data-parallel equality check too: a run of its own would
cost a cluster start."""

from __future__ import annotations

import pytest


def test_remote_reward_down_is_a_user_error(tmp_path):
    from rlhf.spec.errors import UserError
    from rlhf.rewards import Rewards
    from tests.helpers import make_spec

    spec = make_spec(["reward=remote", "reward.remote.urls=[http://127.0.0.1:9]", "reward.remote.retries=0",
                      "reward.remote.timeout_s=2"], tmp_path / "x")
    rewards = Rewards(spec.reward)
    with pytest.raises(UserError, match="did not answer"):
        rewards.score(["p"], ["r"], {"answer": ["a"]})
    rewards.close()
