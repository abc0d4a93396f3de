"""What every worker process does first: threads, seeds, torch.distributed, DeepSpeed's comm.

Workers are Ray actors built by ``rlhf.launch.ActorGroup``. Each receives the frozen RunSpec, its
role, rank and world size, and nothing else from the config. A group of ranks of one role forms
one torch.distributed world (gloo on CPU, NCCL on GPU) whose rank 0 chose MASTER_ADDR/PORT.
"""

from __future__ import annotations

import os
import socket

from rlhf.spec.runspec import RunSpec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"


def skip_deepspeed_shm_build() -> None:
    """On CPU DeepSpeed JIT-compiles a shared-memory all-reduce op (30-40 s) on first init, and
    probes every op builder with compiler subprocesses. Mark the op unavailable instead: gloo
    does the (tiny) collectives."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def skip_unused_imports() -> None:
    """Worker processes use neither MLflow nor scikit-learn nor SciPy, but importing DeepSpeed imports
    MLflow when it is installed (its autotuner, ~4 s of CPU), transformers imports scikit-learn for
    assisted generation (~5 s) and, with every model, ``scipy.optimize`` for its object-detection
    losses (~0.4 s; both hidden by ``rlhf.models.load.skip_sklearn_and_scipy``). Hide them before either library
    loads: every actor starts faster."""
    import sys

    if "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    from rlhf.models.load import skip_sklearn_and_scipy

    skip_sklearn_and_scipy()
    try:  # "Loading weights" / "Writing model shards" bars from every worker would drown the console
        import transformers.utils.logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def offloads_optimizer(spec: RunSpec, role: str) -> bool:
    """``role``'s process steps DeepSpeed's CPU Adam: a trained role of a GPU run with the optimizer
    offloaded (ZeRO >= 1; rlhf.workers.trained)."""
    return (spec.device == "cuda" and spec.train.offload_optimizer and spec.train.zero_stage > 0
            and role in ("actor", "critic"))


def host_optimizer_threads(spec: RunSpec, cores: int) -> int:
    """Threads for one process's CPU Adam: the node's ``cores`` shared by its GPUs, and on a GPU of
    a hybrid placement by the trained roles whose updates run there at once (the actor and PPO's
    critic); RLHF_CPU_THREADS overrides."""
    if os.environ.get("RLHF_CPU_THREADS"):
        return max(1, int(os.environ["RLHF_CPU_THREADS"]))
    per_device = sum(spec.layout.shares("actor", r) for r in ("actor", "critic"))
    return max(1, cores // max(1, spec.hardware.devices_per_node) // max(1, per_device))


def node_cores() -> int:
    """The cores this process may use: those it may run on, within a container's CPU quota
    (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), as Ray counts a node's CPUs."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file:
                with open(period_file) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            cores = min(cores, max(1, int(quota) // int(period)))
        break
    return cores


def use_cpu_threads(n: int) -> None:
    """This process's CPU threads: torch's (and its OpenMP runtime's) and the variable that
    libraries loaded later read."""
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


class Worker:
    """Base of every Ray worker class (the launcher wraps subclasses with ``ray.remote``)."""

    def __init__(self, spec: RunSpec, role: str, rank: int, world_size: int):
        from rlhf.track.worker_logs import log_to_file  # rlhf/track: this process's output to <run dir>/logs/

        log_to_file(spec, role, rank)
        skip_unused_imports()
        self.spec = spec
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.device = spec.device
        import torch

        if self.device == "cpu":
            # the launcher's worker_env sets OMP_NUM_THREADS=1: on a CPU node the roles of a hybrid
            # placement share the cores, and tiny matmuls on 2+ threads each are ~10x slower than
            # on one (spin-waiting); set RLHF_CPU_THREADS to give each worker more
            use_cpu_threads(int(os.environ.get("RLHF_CPU_THREADS") or os.environ.get("OMP_NUM_THREADS")
                                 or max(1, (os.cpu_count() or 1) // max(world_size, 1))))
        elif offloads_optimizer(spec, role):
            # Ray sets OMP_NUM_THREADS to an actor's whole CPUs, at least 1: 1 for every GPU worker
            # here (a share of a GPU bundle's CPU, or its one CPU), and DeepSpeed's CPU Adam is an
            # OpenMP loop: it would step on one core. The op's loop runs on torch's OpenMP runtime
            # (its GOMP symbols resolve through libtorch), whose thread count torch.set_num_threads
            # sets for this thread: the one Ray runs this actor's every call on (max_concurrency 1,
            # rlhf.launch.group.spawn_actor). The variable too, for a build that loads its own.
            use_cpu_threads(host_optimizer_threads(spec, node_cores()))
        torch.manual_seed(spec.train.seed)

    # -- the two-phase start: the launcher asks rank 0 for an address, then sets every rank up
    def address(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank()),
            LOCAL_WORLD_SIZE=str(self.world_size),
        )
        backend = "gloo" if self.device == "cpu" else "nccl"
        if self.device == "cuda":
            torch.cuda.set_device(self.local_device_index())
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.world_size)
        if self.uses_deepspeed():
            if self.device == "cpu":
                skip_deepspeed_shm_build()
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
        self.setup()
        # set-up's temporaries (at ZeRO-3 an fp32 copy of the partition and its clone, 8 bytes per
        # parameter) leave cached blocks that the vLLM engines of a hybrid run need (they start once
        # this returns: rlhf.launch.cluster.engines_wait_for_models), and the first step's peaks
        # should be the step's own
        self.release_cuda_cache()

    def release_cuda_cache(self) -> dict[str, float]:
        """Return PyTorch's cached blocks (the activations of the passes just run) to the device
        before vLLM wakes up on it (hybrid placement); the peaks this process reached since."""
        if self.device != "cuda":
            return {}
        import torch

        torch.cuda.synchronize()
        peaks = self.memory_peaks()
        torch.cuda.empty_cache()
        return {**peaks, f"memory/{self._memory_name()}_resident_gib": torch.cuda.memory_reserved() / 2**30}

    def drop_models(self) -> None:
        """Drop the models (DeepSpeed engines included) this worker holds and give their device memory
        back, before the launcher kills the process mid-run (DPO's reference,
        ``rlhf.launch.group.ActorGroup.release``): ``ray.kill`` returns before the process is gone,
        and the pass that follows on the same GPU is planned without it (docs/memory.md)."""
        import gc

        import torch

        for name in [k for k, v in vars(self).items() if isinstance(v, torch.nn.Module)]:
            delattr(self, name)
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def device_memory_total(self) -> int:
        """Bytes CUDA reports as this process's device's total (what vLLM's gpu_memory_utilization
        is a share of); 0 off CUDA. The driver compares it with hardware.device_memory_gb once per
        run (rlhf.launch.cluster.check_device_memory)."""
        if self.device != "cuda":
            return 0
        import torch

        return int(torch.cuda.mem_get_info()[1])

    def memory_peaks(self) -> dict[str, float]:
        """GiB this process's allocator reserved and its tensors held at most since the last call
        (then the counters restart); none off CUDA. Reserved − allocated is the caching allocator's
        own share (blocks cached but not in use, fragments), which the plan does not predict."""
        if self.device != "cuda":
            return {}
        import torch

        who = self._memory_name()
        out = {f"memory/{who}_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
               f"memory/{who}_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
        torch.cuda.reset_peak_memory_stats()
        return out

    def _memory_name(self) -> str:
        return "train" if self.role == "actor" else self.role  # the actor's figures keep the offload path's names

    def uses_deepspeed(self) -> bool:
        """Training engines do; forward-only workers only under ZeRO-3 (importing it costs seconds)."""
        return True

    def local_rank(self) -> int:
        return 0 if self.device == "cpu" else self.local_device_index()

    def local_device_index(self) -> int:
        return 0  # Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPU

    def setup(self) -> None:
        """Load models and engines (after torch.distributed is up)."""

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()
