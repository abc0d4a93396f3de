"""bench.plan_grid: each cell's choices are the planned spec's own, a cell the plan refuses keeps its
error's first line, and --base names exactly the choices that moved."""

from __future__ import annotations

import json

import pytest

from bench import plan_grid
from tests.helpers import planned_spec


def test_a_cell_holds_the_planned_specs_choices_and_the_diff_names_what_moved(tmp_path, capsys):
    args = ["--models", "qwen2.5-1.5b", "--hardware", "1xh100", "--algos", "grpo", "--lengths", "512", "--kl", "0.001"]
    out = tmp_path / "grid.json"
    assert plan_grid.main([*args, "--out", str(out)]) == 0
    cells = json.loads(out.read_text())
    (cell, got), = cells.items()
    spec = planned_spec(cell.split())
    assert got == {d.key: d.value for d in spec.auto}
    assert got["train.max_tokens_per_micro_batch"] == spec.train.max_tokens_per_micro_batch
    assert got["train.offload_optimizer"] is spec.train.offload_optimizer is False
    # a base where the optimizer was on the host at a larger budget: those two choices, and only they, moved
    old = dict(got, **{"train.max_tokens_per_micro_batch": 16384, "train.offload_optimizer": True})
    (tmp_path / "base.json").write_text(json.dumps({cell: old}))
    capsys.readouterr()
    assert plan_grid.main([*args, "--base", str(tmp_path / "base.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{cell}: train.max_tokens_per_micro_batch 16384 -> {got['train.max_tokens_per_micro_batch']}, "
                     "train.offload_optimizer True -> False",
                     "1 of 1 cells changed (0 do not build)"]


def test_a_cell_the_plan_refuses_keeps_its_errors_first_line():
    got = plan_grid.choices(plan_grid.cell_overrides("qwen2.5-1.5b", "1xh100", "grpo", 512, 0.0,
                                                     ["train.zero_stage=7"]))
    assert isinstance(got, str) and "train.zero_stage=7" in got and "\n" not in got


def test_a_bad_list_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        plan_grid.main(["--lengths", "256,lots"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'256,lots': give comma-separated int values" in err and "Traceback" not in err
