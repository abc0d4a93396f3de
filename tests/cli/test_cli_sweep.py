"""Sweeps (-m): one job per combination, each built like a single run; failures recorded, the sweep goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf import cli, sweep


@pytest.fixture
def fake_execute(monkeypatch, tmp_path):
    """Record each job's spec instead of training; steps=2 crashes, steps=3 returns exit code 3."""
    monkeypatch.chdir(tmp_path)
    seen = []

    def execute(spec):
        seen.append(spec)
        if spec.train.steps == 2:
            raise RuntimeError("boom")
        return 3 if spec.train.steps == 3 else 0

    monkeypatch.setattr(sweep, "execute", execute)
    # no Ray cluster and no MLflow parent run for a stand-in execute (the default hooks start them)
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])
    return seen


class Recorder(sweep.SweepHooks):
    def __init__(self):
        self.calls = []

    def sweep_start(self, sweep_dir, jobs):
        self.calls.append(("sweep_start", len(jobs)))

    def job_start(self, job, spec):
        self.calls.append(("job_start", job.index))

    def job_end(self, job, result):
        self.calls.append(("job_end", job.index, result.status))

    def sweep_end(self, sweep_dir, results):
        self.calls.append(("sweep_end", len(results)))


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(fake_execute, monkeypatch, capsys):
    hooks = Recorder()
    monkeypatch.setattr(sweep, "default_hooks", lambda: [hooks])
    assert cli.main(["-m", "train.steps=1,2,3", "algo=rloo"]) == 1
    assert [(s.train.steps, s.algo.name) for s in fake_execute] == [(1, "rloo"), (2, "rloo"), (3, "rloo")]
    dirs = {s.output_dir for s in fake_execute}
    assert len(dirs) == 3 and all(s.mode == "run" for s in fake_execute)
    sweep_dir = Path(fake_execute[0].output_dir).parent
    results = yaml.safe_load((sweep_dir / "sweep_results.yaml").read_text())
    assert [r["status"] for r in results] == ["ok", "failed", "failed"]
    assert "RuntimeError: boom" in results[1]["error"] and results[2]["error"] == "exit code 3"
    assert (Path(results[1]["output_dir"]) / "error.txt").read_text().startswith("Traceback")
    out = capsys.readouterr().out
    assert "sweep: 3 jobs, 1 ok, 2 failed" in out
    assert hooks.calls == [
        ("sweep_start", 3),
        ("job_start", 0), ("job_end", 0, "ok"),
        ("job_start", 1), ("job_end", 1, "failed"),
        ("job_start", 2), ("job_end", 2, "failed"),
        ("sweep_end", 3),
    ]


def test_a_job_whose_spec_does_not_validate_is_recorded(fake_execute, capsys):
    argv = ["-m", "algo=ppo", "algo.group_size=1", "model=llama3-8b", "hardware=8xh100", "train.prompts_per_step=16,12"]
    assert cli.main(argv) == 1
    assert [s.train.prompts_per_step for s in fake_execute] == [16]
    captured = capsys.readouterr()
    assert "Use train.prompts_per_step=8 (or 16)" in captured.err
    assert ("  #1 failed algo=ppo algo.group_size=1 model=llama3-8b hardware=8xh100 train.prompts_per_step=12  — "
            in captured.out)
    assert "sweep: 2 jobs, 1 ok, 1 failed" in captured.out


def test_a_broken_sweep_stops_before_any_job_with_exit_2(fake_execute, capsys):
    assert cli.main(["-m", "algo=grpo,dpo", "algo.group_size=4"]) == 2
    assert fake_execute == []
    err = capsys.readouterr().err
    assert "job #1 (algo=dpo algo.group_size=4): algo.group_size is not a config key of algo (DPOAlgo)" in err
    assert cli.main(["-m", "algo=grpo,grpoo"]) == 2
    assert "algo 'grpoo' not found" in capsys.readouterr().err


def test_a_plan_sweep_prints_every_plan_and_writes_nothing(fake_execute, tmp_path, monkeypatch, capsys):
    monkeypatch.undo()  # the real execute: plans
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-m", "algo.lr=1e-6,2e-6", "model=qwen2.5-0.5b", "hardware=8xh100", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.count("run: grpo · hybrid · qwen2.5-0.5b · 8xh100") == 2
    assert "=== job #1: algo.lr=2e-06" in out and "lr 2e-06" in out
    assert "sweep: 2 jobs, 2 ok, 0 failed" in out
    assert not (tmp_path / "multirun").exists()


def test_expand_is_the_cartesian_product():
    jobs = sweep.expand(["a.b=1,2", "algo=grpo,ppo,rloo", "x=3"])
    assert len(jobs) == 6 and jobs[0].overrides == ["a.b=1", "algo=grpo", "x=3"]
    assert [j.overrides for j in jobs[:2]] == [["a.b=1", "algo=grpo", "x=3"], ["a.b=1", "algo=ppo", "x=3"]]
    assert [j.overrides for j in sweep.expand(["a=1", "a=2,3", "hydra.job.chdir=true"])] == [["a=2"], ["a=3"]]


@pytest.mark.parametrize("overrides", [
    ["a.b=1,2", "algo=grpo,ppo,rloo", "x=3"],
    ["a=1", "b=range(1,4)", "a=2,3", "c=x,y"],
    ["+new=1,2", "~gone", "s='p,q',r", "l=[1,2],[3]", "c=choice(u,v)", "n=null"],
])
def test_expand_runs_what_hydras_basic_sweeper_runs(overrides):
    """rlhf.sweep enumerates the grid itself (Hydra's BasicSweeper is private API); Hydra still runs
    it, so both must give the same jobs in the same order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from rlhf.config import parse_overrides

    hydra_jobs = BasicSweeper.split_arguments(parse_overrides(overrides), None)[0]
    assert [j.overrides for j in sweep.expand(overrides)] == [list(c) for c in hydra_jobs]


def test_an_interval_with_the_basic_sweeper_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert cli.main(["-m", "algo.lr=interval(1e-6,1e-3)", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: algo.lr=interval(1e-6,1e-3): the basic sweeper runs lists") and "optuna" in err


def test_identical_jobs_are_two_jobs_in_the_summary(fake_execute, capsys):
    """-m train.steps=1,4,1: three jobs, numbered #0, #1, #2 with their own dirs (two identical
    jobs used to be one key: '#2' twice, and job dir 0 recorded as index 2)."""
    assert cli.main(["-m", "train.steps=1,4,1", "tracking.backend=none"]) == 0
    assert [s.train.steps for s in fake_execute] == [1, 4, 1]
    sweep_dir = Path(fake_execute[0].output_dir).parent
    results = yaml.safe_load((sweep_dir / "sweep_results.yaml").read_text())
    assert [r["index"] for r in results] == [0, 1, 2]
    assert [Path(r["output_dir"]).name for r in results] == ["0", "1", "2"]
    out = capsys.readouterr().out
    assert all(f"#{i} ok" in out for i in range(3)), out
