"""Shared fixtures of the RL tests: one Ray instance and one model/data cache for the session,
and a helper that runs ``rlhf-run`` in-process and returns its per-step metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def rl_env(tmp_path_factory):
    """RLHF_CACHE in a session tmp dir and a local Ray (the launcher joins it and leaves it up)."""
    cache = tmp_path_factory.mktemp("rlhf_cache")
    old = os.environ.get("RLHF_CACHE")
    os.environ["RLHF_CACHE"] = str(cache)
    import ray

    started = False
    if not ray.is_initialized():
        from rlhf.launch.group import REPO_ROOT

        ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RLHF_CACHE": str(cache), "OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}})
        started = True
    yield cache
    if started:
        ray.shutdown()
    if old is None:
        os.environ.pop("RLHF_CACHE", None)
    else:
        os.environ["RLHF_CACHE"] = old


def make_spec(overrides: list[str], out_dir: Path):
    from rlhf.cli import build_spec, compose

    overrides = list(overrides) + [f"output_dir={out_dir}", "tracking.console=plain"]
    return build_spec(compose(overrides), overrides, plan=False)


def run_rl(overrides: list[str], out_dir: Path) -> tuple[int, list[dict]]:
    """Run in-process; return (exit code, per-step metrics from metrics.jsonl)."""
    from rlhf.run import run

    code = run(make_spec(overrides, out_dir))
    path = Path(out_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return code, rows


def fifth_means(rows: list[dict], key: str = "reward/mean") -> tuple[float, float]:
    k = max(1, len(rows) // 5)
    vals = [r[key] for r in rows]
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


# The built-in task: random responses score about 0.05, the best constant answer 0.34, the optimum 1.
# With its defaults every RL algorithm ends at 0.96-0.99 (mean of the last 5 of 120 steps, seeds 0-2;
# docs/algorithms.md), so a run ending below LEARNED has stopped learning.
LEARNED = 0.8
RANDOM = 0.2  # the first 5 steps score below this: the reward is learned, not there from the start


def assert_learned(algo: str, code: int, rows: list[dict]) -> None:
    """A run of the defaults finished every step, began near random and ended at >= LEARNED."""
    from rlhf.cli import compose

    assert code == 0
    assert len(rows) == compose([]).train.steps
    reward = [r["reward/mean"] for r in rows]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    print(f"{algo}: reward {first:.3f} (steps 1-5) -> {last:.3f} (last 5 of {len(rows)})")
    assert first < RANDOM, (algo, first)
    assert last >= LEARNED, (algo, first, last)


def _actor_states() -> dict[str, str]:
    """actor id -> state, from the GCS. (``ray.util.state.list_actors`` needs the dashboard, which
    the tests leave off to save memory and start-up time; this is the same table without it.)"""
    from ray._private import state

    return {aid: info["State"] for aid, info in state.actors().items()}


def leftovers(since_actors: set, since_pgs: set) -> tuple[list, list]:
    """Actors alive and placement groups not removed that were not there before."""
    import ray

    alive = [aid for aid, st in _actor_states().items() if st != "DEAD" and aid not in since_actors]
    pgs = [pg_id for pg_id, info in ray.util.placement_group_table().items()
           if info["state"] != "REMOVED" and pg_id not in since_pgs]
    return alive, pgs


def snapshot() -> tuple[set, set]:
    import ray

    return (set(_actor_states()),
            {pg_id for pg_id in ray.util.placement_group_table()})
