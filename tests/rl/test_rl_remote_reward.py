"""A toy RL run scored by a reward server on localhost (``reward.remote``)."""

from __future__ import annotations

import pytest

from tests.helpers import run_rl

STEPS = 3


@pytest.fixture
def server():
    from rlhf.rewards.builtin import keymap_reward
    from rlhf.rewards.server import RewardServer

    calls = []

    def counted(prompts, responses, **meta):
        calls.append(len(responses))
        return keymap_reward(prompts, responses, **meta)

    srv = RewardServer(counted).start()
    srv.calls = calls
    yield srv
    srv.close()


def test_run_with_remote_reward(rl_env, tmp_path, server):
    # the service drives training (weight 1); the same function runs locally with weight 0, so every
    # step's remote part must equal the local part for the same samples
    code, rows = run_rl([
        "algo=grpo", "train.prompts_per_step=16", "rollout.max_response_tokens=4", "train.seed=1",
        f"train.steps={STEPS}", "reward=remote", f"reward.remote.urls=[{server.url}]", "reward.remote.batch_size=24",
        "reward.remote.concurrency=2", "tracking=none",  # the test reads metrics.jsonl alone
        "reward.functions=[{fn: 'rlhf.rewards.builtin:keymap_reward', weight: 0.0, name: local}]",
    ], tmp_path / "remote")
    assert code == 0
    assert len(rows) == STEPS
    assert sum(server.calls) >= STEPS * 16 * 8 // 8  # every sample went to the server, in batches
    assert max(server.calls) <= 24
    for r in rows:
        assert r["reward/remote/mean"] == pytest.approx(r["reward/local/mean"], abs=1e-6)
        assert r["reward/mean"] == pytest.approx(r["reward/remote/mean"], abs=1e-6)
    assert any(r["reward/remote/mean"] > 0 for r in rows)


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
