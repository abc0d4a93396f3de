"""bench.e2e_trl's own side on CPU (``--cpu-test``: tiny model, HF generate, DeepSpeed on gloo), so
that a GPU stretch never finds the comparison broken: the phase table and the separate reference
and old-log-prob pass times (``algo.tis_cap`` forces the old-log-prob pass)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_e2e_bench_runs_our_side_and_reports_each_pass(rlhf_cache, tmp_path):
    # the session's cache only: our side's run starts a Ray of its own (this process needs none)
    (tmp_path / "out").mkdir()
    env = dict(os.environ, RLHF_CACHE=str(rlhf_cache), PYTHONUNBUFFERED="1", OUT=str(tmp_path / "out"))
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "bench.e2e_trl", "--cpu-test", "--sides", "ours", "--kl", "0.001",
                        "--max-new", "8", "--warmup", "1", "--steps", "2", "--ours-extra", "algo.tis_cap=2",
                        "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=280)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    step = re.search(r"^\| \*\*step\*\* \| ([0-9.]+) \| - \|", out, re.M)
    assert step and float(step.group(1)) > 0, out[-3000:]
    passes = re.search(r"^ours, passes: reference ([0-9.]+) s, old log-prob pass ([0-9.]+) s", out, re.M)
    assert passes, out[-3000:]
    # both passes ran in the timed step (2 steps, 1 of them warm-up): paired, with medians
    assert re.search(r"reference ≤ policy in [01] of 1 steps, medians [0-9.]+ / [0-9.]+ s", out), out[-3000:]
    assert re.search(r"^ours: ok, \d+ steps", out, re.M), out[-3000:]
    copied = re.search(r"^ours' per-step metrics: (\S+)$", out, re.M)
    assert copied and Path(copied.group(1)).parent == tmp_path / "out", out[-3000:]
    assert Path(copied.group(1)).read_text().strip(), out[-3000:]


def test_metrics_copy_name_follows_the_settings():
    """Runs with other overrides get other metrics files; the scratch dir does not count."""
    from bench.e2e_trl import ours_metrics_name, parse_args

    base = ["--preset", "qwen2.5-0.5b", "--max-new", "256"]
    name = ours_metrics_name(parse_args(base))
    assert re.fullmatch(r"e2e_ours_metrics_qwen2\.5-0\.5b_256_[0-9a-f]{8}\.jsonl", name)
    assert ours_metrics_name(parse_args(base + ["--work", "/tmp/elsewhere"])) == name
    others = {ours_metrics_name(parse_args(base + extra)) for extra in (
        ["--kl", "0.001"], ["--liger", "true"], ["--ours-tokens", "16384"], ["--ours-extra", "algo.tis_cap=2"])}
    assert name not in others and len(others) == 4
    # --ours-tokens 0: the budget left null, for the plan to choose
    from bench.e2e_trl import ours_overrides

    assert "train.max_tokens_per_micro_batch=null" in ours_overrides(parse_args(base + ["--ours-tokens", "0"]), "m", "p", "r")
    assert "train.max_tokens_per_micro_batch=32768" in ours_overrides(parse_args(base), "m", "p", "r")
    # the GPU's own total, when measured, goes before --ours-extra (which can still set it)
    ov = ours_overrides(parse_args(base + ["--ours-extra", "algo.tis_cap=2"]), "m", "p", "r", 85.0)
    assert ov[-2:] == ["hardware.device_memory_gb=85", "algo.tis_cap=2"]
    assert not any(o.startswith("hardware.device_memory_gb") for o in ours_overrides(parse_args(base), "m", "p", "r"))


def test_gpu_total_is_none_without_a_gpu_and_rounded_down_with_one(monkeypatch):
    import torch

    from bench import e2e_trl

    if not torch.cuda.is_available():
        assert e2e_trl.gpu_total_gb() is None  # the child's CUDA error: no figure, not a crash
    # a child that answers: rounded down to 0.1 GB, as the hardware files state it
    monkeypatch.setattr(e2e_trl.subprocess, "run", lambda *a, **k: e2e_trl.subprocess.CompletedProcess(a, 0, "85019230208\n", ""))
    assert e2e_trl.gpu_total_gb() == 85.0


def test_paired_passes_count_steps_where_the_reference_was_not_slower():
    from bench.e2e_trl import paired_passes

    steps = [{"reference_s": 0.40, "old_logp_s": 0.41}, {"reference_s": 0.45, "old_logp_s": 0.41},
             {"reference_s": 0.41, "old_logp_s": 0.41}, {"reference_s": 0.3}]  # the last ran no policy pass
    assert paired_passes(steps) == {"ref_le_policy_steps": 2, "paired_steps": 3}
    assert paired_passes([{"reference_s": None, "old_logp_s": 0.4}]) == {}
