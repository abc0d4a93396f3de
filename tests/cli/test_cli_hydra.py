"""rlhf-run as a Hydra app: Hydra's flags (--cfg, --info, --shell-completion), hydra.run.dir and
hydra.job.chdir, the Optuna sweeper (a real search on the tiny task, MLflow parent and children),
and the SLURM launcher's config (composed and planned; no SLURM here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf import cli, sweep

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["algo=rloo", "train.steps=3", "algo.kl.coef=0.02", "tracking.backend=none"]


@pytest.fixture
def recording_run(monkeypatch):
    """rlhf.run.run that only writes the run dir's spec.yaml and config.yaml (rlhf.run.write_run_dir)."""
    import rlhf.run

    seen = []

    def run(spec, checked=False):
        seen.append((spec, os.getcwd()))
        rlhf.run.write_run_dir(spec)
        return 0

    monkeypatch.setattr(rlhf.run, "run", run)  # what rlhf.run.execute calls
    return seen


def test_cfg_job_prints_the_config_the_run_writes(recording_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--cfg", "job", *ARGV]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert not (tmp_path / "outputs").exists()  # printing runs nothing
    assert cli.main(ARGV) == 0
    spec, _ = recording_run[0]
    run_dir = Path(spec.output_dir)
    # Hydra's run dir, without Hydra's .hydra/ (hydra.output_subdir=null: the run writes config.yaml)
    assert run_dir.relative_to(tmp_path.resolve()).parts[0] == "outputs" and not (run_dir / ".hydra").exists()
    assert printed == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert printed["algo"]["name"] == "rloo" and printed["train"]["steps"] == 3


def test_cfg_hydra_package_resolve_and_info(capsys):
    assert cli.main(["--cfg", "hydra", "--package", "hydra.run"]) == 0
    assert "dir: outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}" in capsys.readouterr().out
    assert cli.main(["--cfg", "job", "-p", "algo", "algo=ppo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# @package algo") and "name: ppo" in out and "train:" not in out
    assert cli.main(["-c", "hydra", "--resolve", "-p", "hydra.run", "hydra.run.dir=runs/${hydra:job.name}"]) == 0
    assert "dir: runs/rlhf" in capsys.readouterr().out
    assert cli.main(["--info", "defaults", "model=qwen2.5-0.5b"]) == 0
    out = capsys.readouterr().out
    assert "model/qwen2.5-0.5b" in out and "model_defaults/qwen2.5-0.5b" in out
    assert cli.main(["--info", "plugins"]) == 0
    out = capsys.readouterr().out
    assert "OptunaSweeper" in out and "SlurmLauncher" in out


@pytest.mark.parametrize("argv,parts", [
    (["--cfg", "jobs"], ["--cfg jobs: choose one of job, hydra, all"]),
    (["--cfg", "job", "algo.lrr=1"], ["algo.lrr is not a config key", "Did you mean algo.lr?"]),
    (["hydra/launcher=joblib", "--plan"], ["hydra/launcher 'joblib' not found", "submitit_slurm",
                                           "pip install hydra-joblib-launcher"]),
    (["-m", "hydra/sweeper=optuna", "algo.lrr=interval(1e-6,1e-3)", "--plan"], ["algo.lrr is not a config key"]),
    # Hydra's flags of one mode are refused in the others, not dropped
    (["--experimental-rerun", "x.pickle", "--plan"], ["--experimental-rerun", "rlhf-run -cp <run dir> -cn config"]),
    (["--resolve", "--plan"], ["--resolve works only with --cfg job|hydra|all"]),
    (["-m", "-p", "algo", "algo.lr=1e-6,2e-6", "--plan"], ["--package/-p works only with --cfg job|hydra|all"]),
    (["-m", "-r", "algo.lr=1e-6,2e-6", "--plan"], ["-r/--run", "does not go with -m/--multirun: drop -r"]),
    (["--cfg", "job", "--run"], ["-r/--run", "does not go with --cfg"]),
])
def test_config_errors_around_hydra_flags_exit_2(argv, parts, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "Traceback" not in err and out == ""
    for part in parts:
        assert part in err, err


def test_run_flag_is_a_single_run(capsys):
    assert cli.main(["-r", "--plan", "algo=ppo"]) == 0
    assert "run: ppo" in capsys.readouterr().out


def test_shell_completion_installs_and_completes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = subprocess.run([sys.executable, "-m", "rlhf.cli", "-sc", "install=bash"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=120)
    assert script.returncode == 0 and "hydra_bash_completion()" in script.stdout and "complete " in script.stdout
    line = "rlhf-run hardware="
    query = subprocess.run([sys.executable, "-m", "rlhf.cli", "-sc", "query=bash"], capture_output=True, text=True,
                           cwd=tmp_path, env={**env, "COMP_LINE": line, "COMP_POINT": str(len(line))}, timeout=120)
    assert query.returncode == 0, query.stderr
    assert {f"hardware={h}" for h in cli.group_options("hardware")} <= set(query.stdout.split())


def test_hydra_run_dir_and_job_chdir(recording_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*ARGV, "hydra.run.dir=mine/${now:%Y}"]) == 0
    spec, cwd = recording_run[-1]
    assert Path(spec.output_dir).parent == tmp_path.resolve() / "mine" and Path(spec.output_dir, "config.yaml").is_file()
    assert cli.main([*ARGV, "hydra.job.chdir=true"]) == 0
    spec, cwd = recording_run[-1]
    assert os.path.isabs(spec.output_dir) and cwd == spec.output_dir  # the job ran inside its run dir
    assert os.getcwd() == str(tmp_path)  # and the driver is back where it was
    # a relative output_dir is relative to where rlhf-run started, not to the run dir it changes into
    assert cli.main([*ARGV, "hydra.job.chdir=true", "output_dir=runs/x"]) == 0
    spec, cwd = recording_run[-1]
    assert spec.output_dir == cwd == str(tmp_path.resolve() / "runs" / "x")
    assert (tmp_path / "runs" / "x" / "config.yaml").is_file() and not (tmp_path / "runs" / "x" / "runs").exists()


def test_help_shows_ours_and_hydras(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--plan" in out and "resume=DIR" in out
    for flag in ("--cfg", "--resolve", "--package", "--info", "--shell-completion", "hydra.run.dir", "hydra.job.chdir",
                 "hydra/sweeper=optuna", "hydra/launcher=submitit_slurm"):
        assert flag in out, flag


# ----------------------------------------------------------------------------- launchers


def test_a_slurm_sweep_composes_and_plans(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    slurm = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=8",
             "hydra.launcher.timeout_min=600"]
    assert cli.main(["--cfg", "hydra", "-p", "hydra.launcher", *slurm]) == 0
    out = capsys.readouterr().out
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in out
    assert "partition: gpu" in out and "gpus_per_node: 8" in out
    argv = ["-m", *slurm, "model=llama3-8b", "hardware=8xh100", "algo.lr=1e-6,2e-6", "--plan"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("run: grpo · hybrid · llama3-8b · 8xh100") == 2 and "sweep: 2 jobs, 2 ok, 0 failed" in out
    assert not (tmp_path / "multirun").exists()


# ----------------------------------------------------------------------------- Optuna


def test_an_optuna_search_records_failed_trials_and_reports_the_best(tmp_path, monkeypatch, capsys):
    """The real sweeper with a stand-in for training: the objective is train.steps (read back from
    metrics.jsonl), steps=2 fails; every trial is a job, the failed ones recorded, the best reported."""
    import json

    monkeypatch.chdir(tmp_path)

    def execute(spec, checked=False):
        if spec.train.steps == 2:
            return 3
        Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
        rows = [{"step": i, "reward/mean": float(spec.train.steps) + (i == 9)} for i in range(10)]
        Path(spec.output_dir, "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    monkeypatch.setattr(sweep, "execute", execute)
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])
    argv = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=1", f"hydra.sweep.dir={tmp_path / 's'}",
            "train.steps=choice(1,2,4)", "tracking.backend=none"]
    assert cli.main(argv) == 1  # some trials failed
    out = capsys.readouterr().out
    results = yaml.safe_load((tmp_path / "s" / "sweep_results.yaml").read_text())
    assert len(results) == 4
    steps = [int(next(o for o in r["overrides"] if o.startswith("train.steps=")).split("=")[1]) for r in results]
    assert sorted(set(steps)) == [1, 2, 4]  # seed 1 samples every choice in 4 trials
    for r, s in zip(results, steps):
        assert r["status"] == ("failed" if s == 2 else "ok")
        assert r["objective"] == (None if s == 2 else s + 0.5)  # the mean of the last fifth (2 of 10 rows)
    best = yaml.safe_load((tmp_path / "s" / "optimization_results.yaml").read_text())
    assert best["best_params"] == {"train.steps": 4} and best["best_value"] == 4.5
    assert "best: train.steps=4  objective 4.5 (job #" in out and "sweep: 4 jobs, " in out


# The recipe's search at toy size: each trial is a run of its own (workers, export, report), and
# what is checked (a child run per trial with its sampled values, the best one the maximum) needs
# only a few trials of a few steps, not the recipe's 4 × 8 steps of 16 prompts
OPTUNA_TRIALS = 3


@pytest.fixture(scope="module")
def optuna_sweep(rlhf_cache, tmp_path_factory):
    """recipe=grpo_tiny_optuna at toy size: OPTUNA_TRIALS trials in one Ray cluster, tracked in MLflow."""
    from rlhf.sweep import multirun_main

    tmp = tmp_path_factory.mktemp("optuna")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    old = os.getcwd()
    os.chdir(tmp)
    try:
        args = cli.parse_args(["-m", "recipe=grpo_tiny_optuna", f"hydra.sweeper.n_trials={OPTUNA_TRIALS}",
                               "train.steps=2", "train.prompts_per_step=4", "tracking.console=none",
                               f"tracking.uri={uri}", "tracking.experiment=optuna", f"hydra.sweep.dir={tmp / 'sweep'}"])
        code = multirun_main(args)
    finally:
        os.chdir(old)
    return {"code": code, "uri": uri, "dir": tmp / "sweep"}


@pytest.mark.timeout(900)
def test_optuna_search_of_grpo_tiny_in_mlflow(optuna_sweep):
    from mlflow.tracking import MlflowClient

    assert optuna_sweep["code"] == 0
    results = yaml.safe_load((optuna_sweep["dir"] / "sweep_results.yaml").read_text())
    assert len(results) == OPTUNA_TRIALS and all(r["status"] == "ok" for r in results)
    lrs = {next(o for o in r["overrides"] if o.startswith("algo.lr=")) for r in results}
    assert len(lrs) == OPTUNA_TRIALS  # a sampled learning rate per trial, each within the recipe's interval
    assert all(1e-3 <= float(x.split("=")[1]) <= 2e-2 for x in lrs)

    client = MlflowClient(tracking_uri=optuna_sweep["uri"])
    exp = client.get_experiment_by_name("optuna")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == OPTUNA_TRIALS and all(c.info.status == "FINISHED" for c in children)
    by_job = {int(c.data.tags["rlhf.sweep_job"]): c for c in children}
    objectives = [r["objective"] for r in results]
    for r in results:  # each child ran its trial's values; the parent holds its objective
        assert float(by_job[r["index"]].data.params["algo.lr"]) == float(
            next(o for o in r["overrides"] if o.startswith("algo.lr=")).split("=")[1])
    history = client.get_metric_history(parent.info.run_id, "sweep/objective")
    assert sorted(m.step for m in history) == list(range(OPTUNA_TRIALS))  # the job index (Hydra numbers jobs from 0)
    assert sorted(m.value for m in history) == pytest.approx(sorted(objectives))
    best = yaml.safe_load((optuna_sweep["dir"] / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(objectives))  # direction: maximize
    params = parent.data.params
    assert float(params["best.algo.lr"]) == pytest.approx(best["best_params"]["algo.lr"])
    assert float(params["best.algo.kl.coef"]) == pytest.approx(best["best_params"]["algo.kl.coef"])
    assert parent.data.metrics["sweep/best_objective"] == pytest.approx(max(objectives))
    best_job = int(parent.data.tags["rlhf.best_job"])
    assert objectives[best_job] == pytest.approx(max(objectives))


def test_resume_of_a_run_dir_with_a_comma_quotes_and_brackets(recording_run, tmp_path, monkeypatch, capsys):
    """The line a stopped run prints (``continue with rlhf-run resume=...``) resumes a run dir whose
    name Hydra's grammar would split (a comma) or reject (quotes, brackets, a trailing backslash)."""
    import shlex

    from rlhf.quoting import quote_value, resume_command

    monkeypatch.chdir(tmp_path)
    name = "runs/a,b [it's \"x\"] \\"
    assert cli.main([*ARGV, f"output_dir={quote_value(name)}"]) == 0
    run_dir = tmp_path.resolve() / name
    assert recording_run[-1][0].output_dir == str(run_dir) and (run_dir / "config.yaml").is_file()

    argv = shlex.split(resume_command(run_dir))
    assert argv[0] == "rlhf-run" and cli.main([*argv[1:], "train.steps=5"]) == 0
    spec, _ = recording_run[-1]
    assert spec.output_dir == spec.resume == str(run_dir) and spec.train.steps == 5
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]  # no other run dir made

    # unquoted, the grammar reads a comma as two values: one line saying how to quote it
    capsys.readouterr()
    assert cli.main(["resume=runs/a,b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rlhf-run 'resume=\"runs/a,b\"'" in err[0]


def test_info_alone_and_before_overrides(capsys):
    """--info takes an optional topic: alone, or followed by an override, it prints Hydra's info
    (the overrides the CLI adds go before Hydra's flags, not after, where --info would read one)."""
    assert cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert "Installed Hydra Plugins" in out and "rlhf://recipes" in out
    assert cli.main(["--info", "algo=ppo"]) == 0
    assert "algo: ppo" in capsys.readouterr().out
