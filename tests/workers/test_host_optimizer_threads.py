"""DeepSpeed's CPU Adam (an OpenMP loop) in a GPU worker gets the node's cores, not the one thread
Ray gives an actor holding under one CPU (every GPU worker: OMP_NUM_THREADS=1)."""

from __future__ import annotations

import pytest

from rlhf.workers.base import host_optimizer_threads, offloads_optimizer
from tests.helpers import planned_spec

OFFLOAD = ["train.offload_optimizer=true", "train.zero_stage=2"]


@pytest.mark.parametrize("overrides, role, cores, threads", [
    (["hardware=1xh200", *OFFLOAD], "actor", 16, 16),  # GRPO: the actor alone steps on the host
    (["hardware=1xh200", "algo=ppo", *OFFLOAD], "critic", 16, 8),  # PPO hybrid: actor and critic at once
    (["hardware=8xh100", "algo=ppo", *OFFLOAD], "actor", 128, 8),  # 8 GPUs, each the actor's and critic's
    # disaggregated: each role on GPUs of its own, one process a GPU
    (["hardware=8xh100", "algo=ppo", "placement=disaggregated", *OFFLOAD], "critic", 128, 16),
    (["hardware=1xh200", *OFFLOAD], "actor", 1, 1),
])
def test_threads_share_the_node_among_the_optimizers_that_step_at_once(overrides, role, cores, threads):
    spec = planned_spec(overrides)
    assert offloads_optimizer(spec, role)
    assert host_optimizer_threads(spec, cores) == threads


def test_only_offloaded_trained_roles_on_the_gpu_are_given_threads():
    assert not offloads_optimizer(planned_spec(["hardware=1xh200", "train.offload_optimizer=false"]), "actor")
    assert not offloads_optimizer(planned_spec(["hardware=1xh200", *OFFLOAD]), "reference")
    assert not offloads_optimizer(planned_spec(OFFLOAD), "actor")  # CPU runs keep their own rule


def test_node_cores_is_the_affinity_within_a_cpu_quota(monkeypatch, tmp_path):
    import builtins
    import os

    from rlhf.workers import base

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(224)))
    real_open = builtins.open
    files = {"/sys/fs/cgroup/cpu.max": "3200000 100000\n"}  # a 32-CPU container quota

    def fake_open(path, *a, **k):
        if str(path).startswith("/sys/fs/cgroup"):
            if str(path) not in files:
                raise FileNotFoundError(path)
            f = tmp_path / "f"
            f.write_text(files[str(path)])
            return real_open(f, *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert base.node_cores() == 32
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    assert base.node_cores() == 224
    del files["/sys/fs/cgroup/cpu.max"]
    files.update({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "800000\n", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert base.node_cores() == 8  # cgroup v1


def test_a_gpu_workers_thread_count_holds_in_its_later_calls(rl_env):
    """In a Ray actor holding half a CPU, where the process starts with OMP_NUM_THREADS=1, a GPU
    run's actor worker with the optimizer offloaded, made in the actor's constructor (as the
    launcher makes workers), leaves torch and the process's OpenMP runtime at the node's share in
    the actor's later calls (where the optimizer steps)."""
    import ray

    spec = planned_spec(["hardware=1xh200", *OFFLOAD])

    @ray.remote(num_cpus=0.5)
    class Probe:
        def __init__(self, spec):
            import os

            import torch

            from rlhf.workers.base import Worker

            self.before = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
            self.worker = Worker(spec, "actor", 0, 1)

        def threads(self):
            import ctypes
            import os

            import torch

            from rlhf.workers.base import node_cores

            omp = ctypes.CDLL("libgomp.so.1").omp_get_max_threads()  # the runtime torch loaded
            return self.before, (os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), omp), node_cores()

    probe = Probe.remote(spec)
    try:
        before, after, cores = ray.get(probe.threads.remote())
    finally:
        ray.kill(probe)
    want = host_optimizer_threads(spec, cores)
    if want == 1:
        pytest.skip("a one-core machine: the node's share is Ray's one thread, nothing to tell apart")
    assert before == ("1", 1)
    assert after == (str(want), want, want)


@pytest.mark.parametrize("value", ["eight", "0", "-2", "1.5"])
def test_a_bad_rlhf_cpu_threads_stops_the_run_before_it_starts(value, monkeypatch, tmp_path, capsys):
    from rlhf import cli

    monkeypatch.setenv("RLHF_CPU_THREADS", value)
    assert cli.main([f"output_dir={tmp_path / 'run'}", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: RLHF_CPU_THREADS={value!r}: give a positive whole number of CPU threads per worker "
                   "process, or unset it (each worker then takes its share of the node)."]
    assert not (tmp_path / "run").exists()  # nothing made, no cluster
