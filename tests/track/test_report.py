"""The run report from numbers made up here (no run): which panels appear, the phase stack's
arithmetic against an independent float64 sum, the GPU memory panel with the plan's lines, the
image decodes; ``rlhf-report`` redraws from a run dir and refuses a folder that is not one. (The
report of a real run is checked in tests/track/test_trackers.py, on the run shared there.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


def _rows(n: int = 5) -> list[dict]:
    rows = []
    for s in range(n):
        rows.append({"step": s, "reward/mean": 0.1 * s, "reward/min": 0.0, "reward/max": 1.0, "kl/mean": 0.01 * s,
                     "response/length_mean": 30.0 + s, "actor/entropy": 2.0 - 0.1 * s,
                     "time/generate": 1.0 + s, "time/update": 2.0, "time/actor_optimizer_step": 0.5,
                     "time/critic_optimizer_step": 0.25, "time/sync": 0.3, "time/step": 3.5 + s,
                     "memory/train_peak_reserved_gib": 40.0 + s, "memory/train_peak_allocated_gib": 35.0,
                     "memory/vllm_freed_fraction": 0.9})
        if s % 2 == 1:
            rows[-1].update({"eval/greedy/reward_mean": 0.2 * s, "eval/src/greedy/reward_mean": 0.2 * s,
                             "eval/prompts": 8, "time/eval": 9.0})
    return rows


def _write(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "rew')
    (run_dir / "spec.yaml").write_text("algo:\n  name: ppo\n")
    return run_dir


def test_phase_stack_takes_the_optimizer_steps_out_of_the_update():
    from rlhf.report.panels import phase_times

    rows = _rows()
    got = phase_times(rows)
    assert set(got) == {"generate", "update (passes)", "actor optimizer step", "critic optimizer step", "sync"}
    for s, r in enumerate(rows):
        # the stack's top is the phases' sum: update counted once, eval (between steps) not at all
        top = sum(dict(v)[s] for v in got.values())
        assert top == pytest.approx(float(r["time/generate"]) + float(r["time/update"]) + float(r["time/sync"]), abs=1e-12)
        assert dict(got["update (passes)"])[s] == pytest.approx(2.0 - 0.5 - 0.25, abs=1e-12)


def test_report_panels_plan_lines_and_image(tmp_path):
    from PIL import Image

    from rlhf.report import write_report

    run = _write(tmp_path / "run", _rows())
    files = write_report(run, plan_gib={"training phase": 60.0, "generation phase": 70.0})
    assert files.drawn == ["reward", "kl", "response_length", "entropy", "eval", "phase_time", "gpu_memory"]
    assert set(files.absent) == {"loss", "accuracy", "throughput"}
    with Image.open(files.png) as im:
        im.load()
        assert im.format == "PNG" and im.size[0] >= 1000 and im.size[1] >= 4 * 300  # 7 panels: 4 rows
    page = files.html.read_text()
    for key in files.drawn:
        assert f'id="panel-{key}"' in page
    for key in files.absent:
        assert f'id="absent-{key}"' in page
    assert "plan: training phase" in page and "memory/train_peak_reserved_gib" in page
    assert "memory/vllm_freed_fraction" not in page  # a fraction, not GiB
    # the per-source eval figure: in the table, not drawn (it repeats the overall one here)
    assert re.search(r"In the table, not drawn: eval/src/greedy/reward_mean", page)
    assert "data:image/png;base64," in page  # the page carries its image
    # the plan is kept, so a redraw without it still has the lines
    assert json.loads((run / "report" / "plan_memory.json").read_text())["generation phase"] == 70.0
    assert "plan: generation phase" in write_report(run).html.read_text()


def test_supervised_rows_draw_loss_not_reward(tmp_path):
    from rlhf.report import write_report

    rows = [{"step": s, "train/loss": 2.0 / (s + 1), "train/accuracy": 0.5 + 0.1 * s, "time/step": 1.0}
            for s in range(4)]
    files = write_report(_write(tmp_path / "sft", rows))
    assert files.drawn == ["loss", "accuracy"]


def test_rlhf_report_command(tmp_path, capsys):
    from rlhf.report.__main__ import main

    run = _write(tmp_path / "run", _rows(3))
    assert main([str(run)]) == 0
    assert (run / "report" / "report.png").stat().st_size > 10_000
    assert f"report: {run / 'report' / 'report.html'}" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {tmp_path} has no metrics.jsonl" in err
    assert main([]) == 2
