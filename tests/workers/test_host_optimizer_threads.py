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
    (["hardware=8xh100", *OFFLOAD], "actor", 128, 16),  # 8 GPUs' ranks share the node
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


def test_a_gpu_workers_openmp_runtime_gets_the_threads(rl_env):
    """In a Ray actor holding half a CPU (Ray sets OMP_NUM_THREADS=1), a GPU run's actor worker with
    the optimizer offloaded leaves torch and the process's OpenMP runtime (which CPU Adam's loop
    runs on) at the node's share, and the variable set for a runtime loaded later."""
    import os

    import ray

    spec = planned_spec(["hardware=1xh200", *OFFLOAD])

    @ray.remote(num_cpus=0.5)
    class Probe:
        def run(self, spec):
            import ctypes

            import torch

            from rlhf.workers.base import Worker

            before = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
            Worker(spec, "actor", 0, 1)
            omp = ctypes.CDLL("libgomp.so.1").omp_get_max_threads()  # the runtime torch loaded
            cores = len(os.sched_getaffinity(0))
            return before, (os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), omp), cores

    probe = Probe.remote()
    try:
        before, after, cores = ray.get(probe.run.remote(spec))
    finally:
        ray.kill(probe)
    want = host_optimizer_threads(spec, cores)
    assert before == ("1", 1)
    assert after == (str(want), want, want)
