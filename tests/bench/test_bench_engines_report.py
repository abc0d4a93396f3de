"""bench.engines_report on CPU: two stand-in run dirs (metrics.jsonl, the plan's text, nvidia-smi's
samples) as scripts/engines_gpu.sh leaves them; the report's medians skip step 1 and its comparison
is the first run's generation time over the second's. The GPU runs are scripts/gpu.sh's ``engines``."""

from __future__ import annotations

import json

import pytest

from bench import engines_report


def _run(tmp_path, name: str, generate: list[float], mismatch: list[float], plan_gb: float):
    run = tmp_path / name
    run.mkdir()
    rows = [{"step": i + 1, "time/step": g + 3.0, "time/generate": g, "mismatch/logp_abs_mean": m}
            for i, (g, m) in enumerate(zip(generate, mismatch))]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / f"{name}.plan.txt").write_text(f"  generation phase: vLLM weights 1.0 + ... = {plan_gb:.1f} of 141\n")
    (tmp_path / f"{name}.smi").write_text("1000\n40000\n2000\n")
    return run


def test_the_report_compares_the_second_run_with_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_GPU_OUT", str(tmp_path / "out"))
    # step 1 (warm-up) is far off in both and must not count
    one = _run(tmp_path, "e1", [30.0, 6.0, 5.0, 7.0], [0.5, 0.010, 0.011, 0.012], 82.8)
    two = _run(tmp_path, "e2", [40.0, 4.0, 4.2, 3.8], [0.9, 0.011, 0.010, 0.012], 83.8)
    assert engines_report.main([str(one), str(two)]) == 0
    out = json.loads((tmp_path / "out" / "bench_engines_per_device.json").read_text())
    assert out["e1"]["time/generate"] == 6.0 and out["e2"]["time/generate"] == 4.0
    assert out["compare"]["generate_speedup"] == pytest.approx(6.0 / 4.0)
    assert out["compare"]["step_ratio"] == pytest.approx(7.0 / 9.0)
    assert out["compare"]["mismatch_ratio"] == pytest.approx(0.011 / 0.011)
    # how robust the ratio is: every steady step kept, the means' ratio, the first run's best step
    assert out["e1"]["time/generate_steps"] == [6.0, 5.0, 7.0] and out["e2"]["time/generate_mean"] == pytest.approx(4.0)
    assert out["compare"]["generate_speedup_mean"] == pytest.approx(6.0 / 4.0)
    assert out["compare"]["generate_speedup_first_best"] == pytest.approx(5.0 / 4.0)
    assert out["e2"]["plan_generation_phase_gb"] == 83.8
    assert out["e2"]["measured_peak_gb"] == pytest.approx(40000 * 2**20 / 1e9)
    assert "e2 against e1: generate_speedup=1.500" in capsys.readouterr().out


def test_a_run_that_left_no_steps_fails_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_GPU_OUT", str(tmp_path / "out"))
    one = _run(tmp_path, "e1", [30.0, 6.0], [0.5, 0.01], 82.8)
    (tmp_path / "e2").mkdir()
    assert engines_report.main([str(one), str(tmp_path / "e2")]) == 1


def test_three_runs_each_against_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_GPU_OUT", str(tmp_path / "out"))
    base = _run(tmp_path, "e1n", [30.0, 6.0, 6.0], [0.5, 0.010, 0.010], 82.8)
    two = _run(tmp_path, "e2n", [30.0, 4.0, 4.0], [0.5, 0.010, 0.010], 83.8)
    flat = _run(tmp_path, "e2", [30.0, 3.0, 3.0], [0.5, 0.011, 0.011], 83.8)
    assert engines_report.main([str(base), str(two), str(flat)]) == 0
    out = json.loads((tmp_path / "out" / "bench_engines_per_device.json").read_text())
    assert out["compare_e2n"]["generate_speedup"] == pytest.approx(1.5)
    assert out["compare_e2"]["generate_speedup"] == pytest.approx(2.0)
    assert out["compare_e2"]["mismatch_ratio"] == pytest.approx(1.1)
    printed = capsys.readouterr().out
    assert "e2n against e1n: generate_speedup=1.500" in printed and "e2 against e1n: generate_speedup=2.000" in printed
