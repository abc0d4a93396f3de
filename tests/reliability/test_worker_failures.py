"""A rollout engine whose vLLM core died, a worker process that died, and a collective that timed
out, in a GPU run: one line naming the engine or the group, its GPUs, the phase and the step, the
cause and the last checkpoint; through ``rlhf.run.run``: exit 1, that line alone, no actor of the
run left, the checkpoint intact.

No GPU and no vLLM here. Stand-in Ray actors take the places of the workers that fail, and the
real ``Phases`` of the RL loop marks the error: one raises an error with vLLM's class name and
signature (``EngineDeadError``), as ``LLM.generate`` does inside a rollout worker when its engine
core process is gone; one exits mid-call; one raises torch's ``DistBackendError`` with the NCCL
watchdog's text; two form a real gloo group with a 1 s timeout, in which rank 0 waits for an
all-reduce that rank 1 never joins (a real collective timeout, as a ZeRO-3 gather in the weight
sync would have). The other ranks are handles that are never called.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

GPU_RUN = ["hardware=8xh100", "placement=disaggregated", "placement.actor=4",
           "placement.reference=0", "algo.kl.coef=0", "placement.rollout.engines=4",
           "tracking.backend=none", "tracking.console=plain"]  # actor on GPUs 0-3, engines on 4, 5, 6, 7
# vLLM 0.26's check in its memory profiling, as an engine raised it beside loading models (BENCHMARKS §8, s27)
VLLM_PROFILING = ("Error in memory profiling. Initial free memory 44.2 GiB, current free memory 45.78 GiB. This happens "
                  "when other processes sharing the same container release GPU memory while vLLM is profiling during "
                  "initialization. To fix this, ensure consistent GPU memory allocation or isolate vLLM in its own container.")
NCCL_WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, "
                 "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600057 milliseconds before timing out.")


def _stand_in_class():
    """A Ray actor class defined here, so that Ray ships it by value (no import path needed)."""
    import ray

    class EngineDeadError(Exception):
        """vLLM's name and constructor for an engine core process that is gone (v1/engine/exceptions.py)."""

        def __init__(self, *args, suppress_context: bool = False, **kwargs):
            super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.",
                             *args, **kwargs)

    class StandIn:
        def generate(self):
            raise EngineDeadError()

        def exit(self):
            import os

            os._exit(1)

        def update(self):
            import torch.distributed as dist

            raise dist.DistBackendError(NCCL_WATCHDOG)

        def update_until_the_watchdog_ends_it(self):  # what torch's default (TORCH_NCCL_ASYNC_ERROR_HANDLING) does
            import os
            import sys

            sys.stderr.write(f"terminate called after throwing an instance of 'c10::DistBackendError'\n  what():  "
                             f"[PG ID 0 PG GUID 0(default_pg) Rank 2] Process group watchdog thread terminated "
                             f"with exception: {NCCL_WATCHDOG}\n")
            sys.stderr.flush()
            os._exit(134)

        def fail_start(self) -> None:
            self.failing = True

        def address(self):
            return "127.0.0.1", 29500

        def prepare(self) -> None:  # RolloutWorker's imports before its engine starts
            pass

        def init_distributed(self, master_addr: str, master_port: int) -> None:
            if getattr(self, "failing", False):  # what vLLM's LLM(...) raised in a GPU run's start
                raise AssertionError(VLLM_PROFILING)

        def join(self, port: int, rank: int) -> None:
            import datetime

            import torch.distributed as dist

            # the rendezvous with torch's default timeout (the other rank may still be importing
            # torch); the collective under test in a group of its own with a 1 s timeout
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=1))

        def all_reduce(self) -> None:
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.ones(1), group=self.group)

    return ray.remote(num_cpus=0)(StandIn)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}})
    yield _stand_in_class()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def trainers(ray_local):
    """Two stand-in training ranks in one gloo group with a 1 s timeout (torch imported once each)."""
    import ray

    from rlhf.workers.base import free_port

    ranks = [ray_local.remote(), ray_local.remote()]
    port = free_port()
    ray.get([r.join.remote(port, i) for i, r in enumerate(ranks)])
    yield ranks
    for r in ranks:
        ray.kill(r)


def _spec(out, extra=()):
    from rlhf.cli import build_spec, compose

    ov = GPU_RUN + [f"output_dir={out}"] + list(extra)
    return build_spec(compose(ov), ov, plan=False)


def _checkpoint(out, step: int):
    from rlhf.ckpt.manager import CheckpointManager

    out.mkdir(parents=True, exist_ok=True)
    manager = CheckpointManager(out, every=1, keep_last=2)
    tmp = manager.begin(step)
    (tmp / "driver.pt").write_bytes(b"state")
    return manager.commit(tmp, step)


class _Idle:
    """A rank that is never called: only its actor id is looked at."""

    def __init__(self, name):
        self._actor_id = SimpleNamespace(hex=lambda: name)


def _cluster(spec, real: dict):
    """The run's groups, with real stand-in actors at ``real[(role, rank)]``."""
    from rlhf.launch import ActorGroup, Cluster

    groups = {}
    for role in spec.roles:
        n = len(spec.layout.engines) if role == "rollout" else len(spec.layout.roles[role])
        groups[role] = ActorGroup(role, [real.get((role, r)) or _Idle(f"{role}{r}") for r in range(n)])
    return Cluster(spec=spec, groups=groups)


def _fail_in(phase: str, step: int, call, spec):
    """Run ``call`` in ``phase`` of ``step`` (0-based, as the loop counts) and return what escaped."""
    import ray

    from rlhf.loops.rl import Phases

    with pytest.raises(Exception) as info:
        with Phases(spec, step)(phase):
            ray.get(call())
    return info.value


def test_dead_engine_core_is_one_line_through_run_exit_1_nothing_left(ray_local, rlhf_cache, tmp_path, capsys,
                                                                    monkeypatch):
    import ray

    import rlhf.launch
    import rlhf.loops.rl
    from rlhf.run import run

    from tests.helpers import leftovers, snapshot

    out = tmp_path / "run"
    spec = _spec(out)
    saved = _checkpoint(out, 6)
    before = snapshot()
    engine = ray_local.remote()
    cluster = _cluster(spec, {("rollout", 1): engine})

    def loop(spec, cluster, tracker, console, run_dir, **_):  # step 7 of the RL loop, its generate phase
        with rlhf.loops.rl.Phases(spec, 6)("generate"):
            ray.get(cluster.rollout.workers[1].generate.remote())

    monkeypatch.setattr(rlhf.launch, "start_cluster", lambda spec: cluster)
    monkeypatch.setattr(rlhf.loops.rl, "run", loop)
    code = run(spec)
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (
        "error: rollout engine 1 (GPU 5) died during the generate phase of step 7: vLLM's engine core stopped "
        "(EngineDeadError; the engine's log has the cause). Cluster shut down. "
        f"Last checkpoint: {saved} (step 6); continue with resume=<run dir>. Worker logs: {out / 'logs'}/")
    assert (saved / "COMPLETE").is_file() and (saved / "driver.pt").read_bytes() == b"state"
    assert leftovers(*before) == ([], [])  # the stand-in engine was killed with the cluster


def test_an_engine_that_fails_to_start_is_one_line_through_run_exit_1_nothing_left(ray_local, rlhf_cache, tmp_path,
                                                                                  capsys, monkeypatch):
    """A worker that raises while the cluster starts (here vLLM's memory-profiling check) is named
    with its GPU and its error's first line, once the cluster is shut down: no traceback."""
    import ray

    from rlhf.launch import ActorGroup
    from rlhf.launch import cluster as launch_cluster
    from rlhf.run import run

    from tests.helpers import leftovers, snapshot

    out = tmp_path / "run"
    spec = _spec(out, ["placement.actor=1", "placement.rollout.engines=1"])
    before = snapshot()
    actor, engine = ray_local.remote(), ray_local.remote()
    ray.get(engine.fail_start.remote())

    def place(spec, cluster):
        cluster.groups["actor"] = ActorGroup("actor", [actor])
        cluster.groups["rollout"] = ActorGroup("rollout", [engine])

    monkeypatch.setattr(launch_cluster, "init_ray", lambda spec: False)
    monkeypatch.setattr(launch_cluster, "_place", place)
    monkeypatch.setattr(launch_cluster, "check_device_memory", lambda spec, cluster: None)
    code = run(spec)
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"error: rollout engine 0 (GPU 1) failed while the cluster started: {VLLM_PROFILING[:-1]}. "
                        f"Cluster shut down. Worker logs: {out / 'logs'}/")
    assert leftovers(*before) == ([], [])  # both stand-ins killed with the cluster


def test_a_start_error_no_worker_raised_names_nobody():
    from rlhf.launch import Cluster
    from rlhf.launch.failures import start_failure

    assert start_failure(RuntimeError("placement group timed out"), Cluster(spec=None)) is None


def _line_of(tmp_path, role_rank, actor, phase, step, call):
    """The driver's line for ``call(actor)`` failing in ``phase`` of step ``step + 1``."""
    from rlhf.launch.failures import worker_failure

    spec = _spec(tmp_path)
    cluster = _cluster(spec, {role_rank: actor})
    return worker_failure(_fail_in(phase, step, lambda: call(actor), spec), cluster)


def test_dead_engine_process_names_engine_gpu_phase_and_step(ray_local, tmp_path):
    line = _line_of(tmp_path, ("rollout", 2), ray_local.remote(), "generate", 2, lambda a: a.exit.remote())
    assert line.startswith("rollout engine 2 (GPU 6) died during the generate phase of step 3: "
                           "The actor died unexpectedly before finishing this task. Cluster shut down."), line
    assert line.endswith("Cluster shut down. No checkpoint was written yet.") and "\n" not in line, line


def test_nccl_watchdog_timeout_names_the_group_gpus_phase_and_timeout(trainers, tmp_path):
    saved = _checkpoint(tmp_path, 40)
    line = _line_of(tmp_path, ("actor", 1), trainers[1], "update", 40, lambda a: a.update.remote())
    assert "\n" not in line
    assert line.startswith(
        "an NCCL collective of actor ranks 0-3 (GPUs 0-3) timed out after 600 s during the update phase of "
        "step 41, reported by actor rank 1 (GPU 1): Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=41, OpType=ALLREDUCE"), line
    assert "before timing out. Another rank stopped joining: its own error above is the cause" in line
    assert "NCCL_DEBUG=WARN" in line
    assert line.endswith(f"Cluster shut down. Last checkpoint: {saved} (step 40); continue with resume=<run dir>.")


def test_nccl_watchdog_ending_the_process_is_read_from_its_log(ray_local, tmp_path):
    line = _line_of(tmp_path, ("actor", 2), ray_local.remote(), "update", 9,
                    lambda a: a.update_until_the_watchdog_ends_it.remote())
    assert "\n" not in line
    assert line.startswith(
        "an NCCL collective of actor ranks 0-3 (GPUs 0-3) timed out after 600 s during the update phase of "
        "step 10, reported by actor rank 2 (GPU 2), whose process it ended: Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE"), line


def test_real_gloo_timeout_in_the_weight_sync_names_trainer_and_engines(trainers, tmp_path):
    from rlhf.launch.failures import worker_failure

    spec = _spec(tmp_path)
    assert spec.rollout_engine == "vllm"
    ranks = trainers
    cluster = _cluster(spec, {("actor", 0): ranks[0], ("actor", 1): ranks[1]})
    e = _fail_in("sync", 6, lambda: ranks[0].all_reduce.remote(), spec)  # rank 1 never joins it
    line = worker_failure(e, cluster)
    assert "\n" not in line
    assert line.startswith(
        "a gloo collective of actor ranks 0-3 (GPUs 0-3) and rollout engines 0-3 (GPUs 4-7) timed out after 1 s "
        "during the weight sync of step 7, reported by actor rank 0 (GPU 0): Timed out waiting 1000ms for "), line
    assert line.endswith("the network between the processes failed. Cluster shut down. No checkpoint was written yet.")


def test_recognisers_ignore_other_errors():
    from rlhf.launch.failures import collective_timeout, engine_dead, worker_failure

    for e in (RuntimeError("shape mismatch"), ValueError("Timeout in reward function"),
              RuntimeError("NCCL error: unhandled system error")):
        assert collective_timeout(e) is None and engine_dead(e, ("EngineDeadError",)) is None
        assert worker_failure(e, None) is None
    wrapped = RuntimeError("sync failed")
    wrapped.__cause__ = RuntimeError(NCCL_WATCHDOG)  # raised inside DeepSpeed, re-raised from it
    assert collective_timeout(wrapped) == (600.0, "NCCL", NCCL_WATCHDOG[len("[Rank 1] "):-1])
