"""The agent recipes learn on CPU: SFT of the tiny chat model on demonstrations (recipe
agent_sft_tiny, the module's one SFT run), then GRPO through the agent loop from it:

    agent_lookup_tiny   key → value with the table behind the lookup tool (hybrid placement)
    agent_code_tiny     a function written to a spec, rewarded by its sandboxed unit tests
                        (disaggregated placement)

Each GRPO run's held-out reward is its own evaluation on the eval split, before the first step
(eval_before/...) and after the last (eval/...), of responses sampled as in training (temperature 1):
after SFT the greedy answers are already (near) 1.0, the sampled ones are not. The margins were stated
before the GRPO stages were first run, and kept when the recipes changed (lr, the lookup
demonstrations' noise, the code stage's eval samples; docs/agent.md says why): the held-out sampled
reward rises by at least MARGIN on both. Measured over seeds and kernel paths (scripts/learning_margins.sh,
the table in docs/agent.md: kernels default and avx2, seeds 0-2): lookup +0.25 to +0.33, code
+0.25 to +0.36.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import record_learning, run_rl

# Kept out of the default suite (the suite's 10-min budget): the module takes ~1.6 min on the 2-core
# machine at load 3-5 and 2.7-5.2 min at load 7-16 (SFT ~1 min, each GRPO stage ~40 s there).
# `make test-slow` runs it.
pytestmark = pytest.mark.slow

MARGIN = {"lookup": 0.10, "code": 0.10}


@pytest.fixture(scope="module")
def agent_dir(rl_env, tmp_path_factory):
    """RLHF_AGENT_DIR with the SFT stage done (recipe=agent_sft_tiny → <dir>/sft/final/hf)."""
    d = tmp_path_factory.mktemp("agent")
    old = os.environ.get("RLHF_AGENT_DIR")
    os.environ["RLHF_AGENT_DIR"] = str(d)
    code, rows = run_rl(["recipe=agent_sft_tiny"], d / "sft")
    assert code == 0 and (d / "sft" / "final" / "hf" / "config.json").exists()
    yield d
    if old is None:
        os.environ.pop("RLHF_AGENT_DIR", None)
    else:
        os.environ["RLHF_AGENT_DIR"] = old


def _gain(rows: list[dict]) -> tuple[float, float]:
    before = next(r["eval_before/sampled/reward_mean"] for r in rows if "eval_before/sampled/reward_mean" in r)
    after = rows[-1]["eval/sampled/reward_mean"]
    return before, after


def test_lookup_tool_recipe_learns(agent_dir):
    code, rows = run_rl(["recipe=agent_lookup_tiny"], agent_dir / "lookup")
    assert code == 0
    for r in rows:  # the step's agent metrics are logged
        for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_errors/malformed",
                    "agent/tool_latency_p50", "agent/tool_latency_p99", "agent/sandbox_kills/cpu",
                    "agent/truncated_frac"):
            assert key in r, key
    assert max(r["agent/tool_calls_mean"] for r in rows) > 0.5  # the policy uses the tool
    before, after = _gain(rows)
    record_learning("agent/lookup-tool", "held-out sampled reward gain (GRPO after SFT)", after - before,
                    MARGIN["lookup"])
    assert after >= before + MARGIN["lookup"], (before, after)


def test_code_recipe_learns_from_sandboxed_tests(agent_dir):
    code, rows = run_rl(["recipe=agent_code_tiny"], agent_dir / "code")
    assert code == 0
    assert all(r["agent/turns_mean"] == 1.0 for r in rows)
    before, after = _gain(rows)
    record_learning("agent/code", "held-out sampled reward gain (GRPO after SFT)", after - before, MARGIN["code"])
    assert after >= before + MARGIN["code"], (before, after)
