"""End to end through `rlhf-run` (launcher, Ray actors, DeepSpeed workers), toy size on CPU:

* SFT → reward model → PPO (recipes pipeline_sft / pipeline_rm / pipeline_ppo), each stage
  reading the previous stage's final/hf: SFT lowers the held-out loss, the reward model ranks
  >= 90% of held-out pairs right, PPO against it raises both its score and the task's true reward.
* DPO (recipe dpo_tiny): held-out preference accuracy >= 90%.

One Ray instance serves every run of this module.
"""

from __future__ import annotations

import json
import os

import pytest

QUIET = ["tracking=none", "tracking.console=plain"]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rlhf.workers.base import skip_deepspeed_shm_build  # noqa: F401  (import check only)

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def pipeline_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_PIPELINE_DIR", str(tmp_path))
    return tmp_path


def _run(*args) -> None:
    from rlhf.cli import main

    assert main([*args, *QUIET]) == 0


def _final(path) -> dict:
    return json.loads((path / "final" / "metrics.json").read_text())


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _mean(rows, key) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_sft_then_reward_model_then_ppo(ray_session, pipeline_dir):
    _run("recipe=pipeline_sft")
    sft = _final(pipeline_dir / "sft")
    assert sft["eval/loss_after"] < 0.5 * sft["eval/loss_before"], sft
    assert (pipeline_dir / "sft" / "final" / "hf" / "config.json").exists()

    _run("recipe=pipeline_rm")
    rm = _final(pipeline_dir / "rm")
    assert rm["eval/accuracy_after"] >= 0.9, rm
    cfg = json.loads((pipeline_dir / "rm" / "final" / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and len(cfg["id2label"]) == 1

    _run("recipe=pipeline_ppo")
    steps = _steps(pipeline_dir / "ppo")
    first, last = steps[:2], steps[-4:]
    true_before, true_after = _mean(first, "reward/keymap_reward/mean"), _mean(last, "reward/keymap_reward/mean")
    rm_before, rm_after = _mean(first, "reward/model/mean"), _mean(last, "reward/model/mean")
    print(f"PPO: true reward {true_before:.3f} -> {true_after:.3f}, RM score {rm_before:.3f} -> {rm_after:.3f}")
    assert true_after > true_before + 0.05
    assert rm_after > rm_before


def test_dpo_preference_accuracy(ray_session, tmp_path):
    _run("recipe=dpo_tiny", f"output_dir={tmp_path / 'dpo'}")
    dpo = _final(tmp_path / "dpo")
    print(f"DPO: held-out accuracy {dpo['eval/accuracy_before']:.3f} -> {dpo['eval/accuracy_after']:.3f}")
    assert dpo["eval/accuracy_after"] >= 0.9, dpo
    assert dpo["eval/margin_after"] > 0
