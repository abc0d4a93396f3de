"""Steps count from 1 everywhere (console, metrics.jsonl, every tracker, checkpoint names); a
resumed run keeps the metrics lines of the steps its checkpoint holds (1..N) and rewrites the rest."""

from __future__ import annotations

import io
import json


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_console_prints_the_step_it_is_given():
    from rlhf.track import Console

    out = io.StringIO()
    Console("plain", 3, stream=out).step(1, {"reward/mean": 0.5})
    assert out.getvalue().startswith("step 1/3 · ")


def test_rl_resume_keeps_the_lines_of_the_checkpointed_steps(tmp_path):
    from rlhf.loops.rl import _keep_metrics_before

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": float(s)}) + "\n" for s in (1, 2, 3, 4)))
    _keep_metrics_before(path, 2)  # resumed from step_00000002: steps 1 and 2 are done
    assert [r["step"] for r in _lines(path)] == [1, 2]


def test_supervised_resume_keeps_the_steps_and_evaluations_up_to_the_checkpoint(tmp_path):
    from rlhf.loops.supervised import keep_metrics_before

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/loss": 2.0}, {"step": 1, "train/loss": 1.5}, {"step": 2, "train/loss": 1.2},
            {"step": 2, "eval/loss": 1.1}, {"step": 3, "train/loss": 1.0}, {"step": 4, "train/loss": 0.9},
            {"step": 4, "eval/loss": 0.8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keep_metrics_before(path, 2)  # the checkpoint after step 2 (and its epoch's evaluation)
    assert _lines(path) == rows[:4]
