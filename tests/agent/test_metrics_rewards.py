"""Per-step agent metrics from trajectories, and the sandboxed code reward."""

from __future__ import annotations

import math
import random

import pytest

from rlhf.agent.metrics import percentile, step_metrics
from rlhf.agent.rewards import code_reward, extract_code, parse_tests, pass_fractions
from rlhf.agent.sandbox import SandboxLimits, SandboxPool
from rlhf.agent.tools import ToolOutcome
from rlhf.agent.trajectory import Trajectory


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy_linear(n):
    import numpy as np

    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 100):
        assert math.isclose(percentile(xs, q), float(np.percentile(np.array(xs, dtype=np.float64), q)),
                            rel_tol=1e-12, abs_tol=1e-15)
    assert math.isnan(percentile([], 50))


def traj(turns, finish, outcomes, sampled=3, total=10, wall=1.0):
    t = Trajectory(token_ids=list(range(total)), loss_mask=[1] * sampled + [0] * (total - sampled),
                   logprobs=[0.0] * total, prompt_len=0, messages=[])
    t.turns, t.finish, t.outcomes, t.wall_s = turns, finish, outcomes, wall
    return t


def test_step_metrics_count_what_happened():
    ok = lambda s: ToolOutcome("f", "x", None, s)  # noqa: E731
    trajs = [
        traj(3, "stop", [ok(0.1), ok(0.3), ToolOutcome("python", "e", "sandbox", 2.0, "cpu")]),
        traj(1, "turns", [ToolOutcome("", "e", "malformed", 0.0)], wall=4.0),
        traj(2, "length", [ToolOutcome("f", "e", "timeout", 5.0, "wall"), ToolOutcome("g", "e", "unknown_tool", 0.0)]),
        traj(1, "stop", []),
    ]
    m = step_metrics(trajs)
    assert m["agent/turns_mean"] == 7 / 4 and m["agent/turns_max"] == 3
    assert m["agent/tool_calls_mean"] == 6 / 4 and m["agent/tool_calls_max"] == 3
    assert m["agent/tool_errors/sandbox"] == 1 and m["agent/tool_errors/malformed"] == 1
    assert m["agent/tool_errors/timeout"] == 1 and m["agent/tool_errors/unknown_tool"] == 1
    assert m["agent/tool_errors/raised"] == 0 and m["agent/tool_error_frac"] == 4 / 6
    assert m["agent/sandbox_kills/cpu"] == 1 and m["agent/sandbox_kills/wall"] == 1 and m["agent/sandbox_kills/memory"] == 0
    ran = [0.1, 0.3, 2.0, 5.0]  # the refused calls (malformed, unknown tool) do not count as latency
    assert math.isclose(m["agent/tool_latency_p50"], percentile(ran, 50))
    assert math.isclose(m["agent/tool_latency_p50"], 1.15) and math.isclose(m["agent/tool_latency_p99"], 4.91)
    assert m["agent/truncated_frac"] == 0.5
    assert m["agent/finish/stop"] == 0.5 and m["agent/finish/turns"] == 0.25 and m["agent/finish/length"] == 0.25
    assert m["agent/assistant_tokens_mean"] == 3 and m["agent/wall_s_max"] == 4.0
    assert step_metrics([]) == {}

# ------------------------------------------------------------------------------- the code reward


TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(SandboxLimits(cpu_s=1, wall_s=20.0, memory_mb=512, output_bytes=16 * 1024), workers=2)
    yield p
    p.close()


def test_code_reward_is_the_fraction_of_tests_passed(pool):
    codes = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return a + b if a >= 0 else 7\n",  # fails the second test only
        "def add(a, b):\n    return 3\n",  # passes the first only
        "def add(a, b) return a + b",  # syntax error
        "while True:\n    pass",  # killed by the CPU limit
        "import os\nos._exit(0)",  # exits before the tests
        "print('\\nPASSED 4')\ndef add(a, b):\n    return 0\n",  # a fake count cannot name the marker: 1 of 4 real
        "import sys\nsys.exit(0)\n",
    ]
    got = pass_fractions(codes, [TESTS] * len(codes), pool)
    assert got == [1.0, 0.75, 0.25, 0.0, 0.0, 0.0, 0.25, 0.0]


class CountingPool:
    """The pool, counting the programs it is given."""

    def __init__(self, pool):
        self.pool, self.programs = pool, []

    def map(self, programs, limits=None):
        self.programs += programs
        return self.pool.map(programs, limits=limits)


def test_identical_code_and_tests_run_once(pool):
    add, three = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 3\n"
    counting = CountingPool(pool)
    got = pass_fractions([add, three, add, add, three], [TESTS, TESTS, TESTS, TESTS[:1], "\n".join(TESTS)], counting)
    assert got == [1.0, 0.25, 1.0, 1.0, 0.25]
    # (add, all four), (three, all four: as a list and as lines alike), (add, the first alone)
    assert len(counting.programs) == 3


def test_code_reward_as_a_reward_function(monkeypatch, pool):
    """Loaded by name through the reward loader, fed the ``tests`` column as metadata."""
    from rlhf.agent import rewards
    from rlhf.rewards.loader import Rewards
    from rlhf.spec.schema import RewardFnSpec, RewardSpec

    monkeypatch.setattr(rewards, "default_pool", lambda: pool)
    spec = RewardSpec(name="code", functions=[RewardFnSpec(fn="rlhf.agent.rewards:code_reward")])
    responses = ["Here:\n```python\ndef add(a, b):\n    return a + b\n```", "```python\ndef add(a, b):\n    return 3\n```"]
    total, parts = Rewards(spec).score(["p", "p"], responses, {"tests": ["\n".join(TESTS), TESTS]})
    assert total == [1.0, 0.25] and parts == {"code_reward": [1.0, 0.25]}
    assert code_reward is rewards.code_reward


def test_tests_cells_and_code_blocks():
    assert parse_tests("assert a\n\nassert b\n") == ["assert a", "assert b"]
    assert parse_tests('["assert a", "assert b"]') == ["assert a", "assert b"]
    assert parse_tests(["assert a", " "]) == ["assert a"]
    assert extract_code("x\n```python\nA\n```\ny\n```py\nB\n```") == "B\n"
    assert extract_code("def f(): pass") == "def f(): pass"
