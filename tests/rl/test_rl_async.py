"""Async rollouts (algo.async_steps=1) in hybrid placement: generation of step t+1 overlaps the update
of step t, by two HF engines sharing the one CPU slot (placement.rollout.engines_per_device=2: each a
process, the prompts split between them; their seeded samples are those of one engine)."""

from __future__ import annotations

import yaml

from tests.helpers import fifth_means, record_learning, run_rl

STEPS = 60  # 20 gained 0.065 on one seed and kernel path (docs/learning-margins.md); 60 leave a margin


def test_async_one_step_learns_and_overlaps(rl_env, tmp_path):
    # algo.lr=5e-3: faster than the tiny model's default, so that 60 steps show learning
    code, rows = run_rl(["algo=grpo", "train.prompts_per_step=16", "rollout.max_response_tokens=4", "train.seed=1",
                         "algo.lr=5e-3", f"train.steps={STEPS}", "algo.async_steps=1", "algo.tis_cap=2.0",
                         "placement.rollout.engines_per_device=2", "tracking=none"],  # metrics.jsonl is all it reads (the same metrics without a tracker)
                        tmp_path / "async")
    assert code == 0
    assert len(rows) == STEPS
    # the default placement, hybrid: the engine shares the trainers' device and (auto) never sleeps
    placement = yaml.safe_load((tmp_path / "async" / "spec.yaml").read_text())["placement"]
    assert placement["mode"] == "hybrid" and placement["sleep_rollout"] is False
    spec = yaml.safe_load((tmp_path / "async" / "spec.yaml").read_text())
    assert spec["layout"]["engines"] == [[0], [0]]  # two engines on the one slot
    assert rows[0]["async/staleness"] == 0.0  # the first batch is sampled before any update
    assert all(r["async/staleness"] == 1.0 for r in rows[1:])
    # the prefetched generation ran while the trainer updated: part of it was hidden behind the update
    assert sum(r["async/overlap_s"] for r in rows[1:]) > 0
    assert all(0 <= r["async/overlap_s"] <= r["async/generate_s"] + 1e-6 for r in rows)
    assert all("actor/tis_weight_mean" in r for r in rows)  # the importance-sampling correction ran
    first, last = fifth_means(rows)
    record_learning("rl/async", "reward gain, last fifth - first", last - first, 0.08)
    assert last >= first + 0.08, (first, last)
