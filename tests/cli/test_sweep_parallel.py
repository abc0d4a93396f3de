"""hydra/launcher=parallel: the jobs of a sweep that fit side by side on the Ray cluster's devices
(on CPU its worker slots, ``ray.num_cpus``) run at the same time; the next job waits for room; one
larger than the cluster fails alone. The default launcher stays sequential (test_cli_sweep.py)."""

from __future__ import annotations

import threading

import pytest
import yaml

from rlhf import cli, sweep, sweep_parallel


def _overlap(a: dict, b: dict) -> bool:
    return a["started"] < b["ended"] and b["started"] < a["ended"]


def _no_ray_left_by_other_files() -> None:
    """Another test file run earlier in this process (one xdist worker runs several) may have left
    its session's Ray cluster up; these tests need clusters of their own size, so it goes (later
    runs start a cluster of their own)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def no_ray():
    _no_ray_left_by_other_files()


@pytest.fixture(scope="module")
def two_slot_ray():
    """A Ray cluster of 2 worker slots (2 logical CPUs), as a fake 2-device cluster, shared by the
    stand-in sweeps of this module (each sweep leaves a cluster it did not start up). No idle
    workers started ahead (as rlhf.launch.cluster.init_ray): the stand-in jobs start no actors."""
    import ray

    _no_ray_left_by_other_files()
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
    yield
    ray.shutdown()


def test_jobs_wait_for_room_and_a_too_large_job_fails_alone(two_slot_ray, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])  # the test's own Ray cluster, no MLflow
    threads = {}
    both = threading.Barrier(2, timeout=60)  # passed only while the first two jobs run at once

    def execute(spec):  # a stand-in job
        threads[spec.train.steps] = threading.current_thread().name
        if spec.train.steps < 3:
            both.wait()
        return 0

    monkeypatch.setattr(sweep, "execute", execute)
    # the stand-in jobs import nothing: skip the launcher's transformers warm-up (seconds of torch import)
    monkeypatch.setattr(sweep_parallel, "_resolve_lazy_imports", lambda: None)
    argv = ["-m", "hydra/launcher=parallel", "train.steps=1,2,3", f"hydra.sweep.dir={tmp_path / 'a'}"]
    assert cli.main(argv) == 0
    r = yaml.safe_load((tmp_path / "a" / "sweep_results.yaml").read_text())
    assert [x["status"] for x in r] == ["ok", "ok", "ok"]
    assert _overlap(r[0], r[1])  # 1 slot each, 2 slots: side by side (else the barrier breaks: failed)
    assert r[2]["started"] >= min(r[0]["ended"], r[1]["ended"])  # the third waited for a free slot
    assert len(set(threads.values())) >= 2 and threading.current_thread().name not in threads.values()

    argv = ["-m", "hydra/launcher=parallel", "hardware.devices_per_node=1,4", "train.prompts_per_step=8",
            f"hydra.sweep.dir={tmp_path / 'b'}"]
    assert cli.main(argv) == 1
    r = yaml.safe_load((tmp_path / "b" / "sweep_results.yaml").read_text())
    assert [x["status"] for x in r] == ["ok", "failed"]
    assert r[1]["error"].startswith("it needs 4 CPUs and the Ray cluster has 2: set ray.num_cpus")
    assert "error: job #1: it needs 4 CPUs" in capsys.readouterr().err


def test_jobs_that_would_overfill_the_disk_together_run_one_after_the_other(two_slot_ray, real_disk, tmp_path, monkeypatch):
    """Two jobs with room for both in slots, but a disk with room for one job's checkpoints and
    export at a time: the second starts only after the first has ended. The plan's figure is a
    stand-in (1 GB a job); rlhf.plan.disk.need itself is tested in test_spec_disk."""
    from rlhf import storage
    from rlhf.plan import disk

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])
    monkeypatch.setattr(sweep_parallel, "_resolve_lazy_imports", lambda: None)
    monkeypatch.setattr(disk, "need", lambda spec: disk.DiskNeed({"actor": 1.0}, 1))
    second_started = threading.Event()

    patience = {"s": 3.0}

    def execute(spec):  # the first job runs until the second starts (``patience`` at most)
        if spec.train.steps == 2:
            second_started.set()
        else:
            second_started.wait(timeout=patience["s"])
        return 0

    monkeypatch.setattr(sweep, "execute", execute)

    def sweep_with_free(free_gb: float, name: str, wait_s: float) -> list[dict]:
        second_started.clear()
        patience["s"] = wait_s
        monkeypatch.setattr(storage, "free_bytes", lambda path: int(free_gb * 1e9))
        argv = ["-m", "hydra/launcher=parallel", "train.steps=1,2", f"hydra.sweep.dir={tmp_path / name}"]
        assert cli.main(argv) == 0
        r = yaml.safe_load((tmp_path / name / "sweep_results.yaml").read_text())
        assert [x["status"] for x in r] == ["ok", "ok"]
        return r

    one_at_a_time = sweep_with_free(1.5, "a", 3)  # 95 % of 1.5 GB: one job's 1 GB, not two
    assert one_at_a_time[1]["started"] >= one_at_a_time[0]["ended"]
    side_by_side = sweep_with_free(2.5, "b", 60)  # room for both: the slots decide, as before
    assert _overlap(side_by_side[0], side_by_side[1])


def test_chdir_is_refused(no_ray, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])
    assert cli.main(["-m", "hydra/launcher=parallel", "hydra.job.chdir=true", "train.steps=1,2"]) == 2
    assert "drop hydra.job.chdir=true" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_two_toy_jobs_run_side_by_side_on_a_2_slot_cluster(no_ray, rlhf_cache, tmp_path, monkeypatch):
    """The real thing: two GRPO toy runs, one slot each, on a sweep cluster of 2 slots; both run at
    once and finish, each is an MLflow child run of the sweep's parent."""
    import ray
    from mlflow.tracking import MlflowClient

    both = threading.Barrier(2, timeout=120)  # each run starts only once the other has its slot too
    real = sweep.execute

    def execute(spec):
        both.wait()
        return real(spec)

    monkeypatch.setattr(sweep, "execute", execute)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = cli.main([
        "-m", "hydra/launcher=parallel", "ray.num_cpus=2", "algo=grpo", "algo.kl.coef=0", "algo.lr=1e-6,2e-6",
        "train.steps=1", "train.prompts_per_step=4", "rollout.max_response_tokens=2", "algo.group_size=2",
        "tracking.console=plain", f"tracking.uri={uri}", "tracking.experiment=par", f"hydra.sweep.dir={tmp_path / 's'}",
    ])
    assert code == 0
    assert not ray.is_initialized()  # the sweep's cluster is shut down after the last job
    r = yaml.safe_load((tmp_path / "s" / "sweep_results.yaml").read_text())
    assert [x["status"] for x in r] == ["ok", "ok"]
    assert _overlap(r[0], r[1]), r
    for i in (0, 1):
        assert (tmp_path / "s" / str(i) / "final" / "hf" / "config.json").is_file()

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("par").experiment_id])
    parent = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = {x.data.tags["rlhf.sweep_job"]: x for x in runs
                if x.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id}
    assert sorted(children) == ["0", "1"] and all(c.info.status == "FINISHED" for c in children.values())
    assert children["1"].data.params["algo.lr"] == "2e-06"  # each child run is its own job's
