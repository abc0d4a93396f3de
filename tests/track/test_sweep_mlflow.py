"""A 3-job sweep at toy size, in one Ray cluster: one MLflow parent run and three child runs, the
jobs' W&B runs (offline) in one group and their TensorBoard event files one folder per job; the
job made to fail (a data file that does not exist) is a FAILED child and the sweep goes on; no
actor or placement group is left in the cluster after each job and after the sweep."""

from __future__ import annotations

import os
import time

import pytest

from rlhf.sweep import SWEEP_CPU_SLOTS, SweepHooks


def _wait_clean(before) -> tuple[list, list]:
    from tests.helpers import leftovers

    for _ in range(50):  # ray.kill is asynchronous: give the GCS a moment
        actors, pgs = leftovers(*before)
        if not actors and not pgs:
            break
        time.sleep(0.2)
    return actors, pgs


class LeakCheck(SweepHooks):
    """Runs after the Ray hook started the sweep's cluster: snapshots it before the first job and
    checks it after every job (the last check is the cluster as the sweep leaves it)."""

    def __init__(self):
        self.before = None
        self.after_jobs: list = []
        self.slots = None

    def job_start(self, job, spec):
        import ray

        from tests.helpers import snapshot

        if self.before is None and ray.is_initialized():
            self.before = snapshot()
            self.slots = ray.cluster_resources().get("CPU")

    def job_end(self, job, result):
        import ray

        if self.before is not None and ray.is_initialized():
            self.after_jobs.append(_wait_clean(self.before))



@pytest.mark.timeout(1500)  # two toy jobs start workers; minutes on a loaded 2-core machine
def test_sweep_parent_children_failed_job_no_leftovers(rlhf_cache, tmp_path, monkeypatch, capfd):
    from mlflow.tracking import MlflowClient

    from rlhf.cli import parse_args
    from rlhf.sweep import MlflowSweepHooks, RaySweepHooks, multirun_main
    from rlhf.track.sweep_group import TrackerSweepHooks
    from tests.track import tb_events, wandb_log

    import ray

    # the sweep starts its own cluster (what the slot count below checks), not the 8-slot one that
    # tests/conftest.py's rl_env leaves up for later modules in this process (it starts again there)
    ray.shutdown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    missing = tmp_path / "missing.jsonl"
    args = parse_args([
        "-m", "algo=grpo", "algo.kl.coef=0", "train.steps=1", "train.prompts_per_step=4", "rollout.max_response_tokens=2",
        "algo.group_size=2", "tracking.console=plain", f"tracking.uri={uri}", "tracking.experiment=sweep-test",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "tracking.backend=[mlflow,tensorboard,wandb]",
        f"data.train_files=[builtin:keymap/train],[{missing}],[builtin:keymap/eval]",
    ])
    check = LeakCheck()
    code = multirun_main(args, hooks=[RaySweepHooks(), check, MlflowSweepHooks(), TrackerSweepHooks()])
    assert code == 1  # one job failed, the others ran
    # the sweep's cluster is started as a run's is (rlhf.launch.cluster.init_ray: Ray's own INFO lines
    # off), with room for any job's layout on CPU
    assert "Started a local Ray instance" not in capfd.readouterr().err
    assert check.slots == max(os.cpu_count() or 1, SWEEP_CPU_SLOTS)

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["rlhf.sweep_failed"] == "1"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3
    by_job = {r.data.tags["rlhf.sweep_job"]: r for r in children}
    assert {k: r.info.status for k, r in by_job.items()} == {"0": "FINISHED", "1": "FAILED", "2": "FINISHED"}
    assert client.get_metric_history(by_job["0"].info.run_id, "reward/mean")
    # params are the flattened spec; artifacts the resolved spec, the overrides and the model path
    assert by_job["2"].data.params["train.steps"] == "1"
    arts = {a.path for a in client.list_artifacts(by_job["2"].info.run_id)}
    assert {"spec.yaml", "config.yaml", "overrides.txt", "model_path.txt", "final_model_path.txt"} <= arts

    assert len(check.after_jobs) == 3 and all(a == ([], []) for a in check.after_jobs), check.after_jobs
    assert (tmp_path / "sweep" / "0" / "final" / "hf" / "config.json").is_file()
    # W&B: the jobs that ran are one group, named after the sweep dir; TensorBoard: a folder a job
    groups = {}
    for job in ("0", "2"):
        (log,) = (tmp_path / "sweep" / job / "wandb").glob("offline-run-*/run-*.wandb")
        run = wandb_log.run_record(wandb_log.closed(log))
        groups[job] = (run.run_group, run.display_name)
        assert tb_events.scalars(tmp_path / "sweep" / job / "tensorboard")["reward/mean"]
    group = f"sweep {tmp_path.name}/sweep"
    assert groups == {"0": (group, "sweep/0"), "2": (group, "sweep/2")}
