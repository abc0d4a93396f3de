"""``rlhf-run -m hydra/launcher=parallel ...``: the jobs of a sweep that fit side by side on the Ray
cluster's devices run at the same time, in threads of this process sharing the sweep's one Ray
cluster; each job reserves its own placement groups, as a single run does.

A job takes ``layout.total_devices`` devices: GPUs, or on CPU worker slots (Ray CPUs; ``ray.num_cpus``
sets how many the sweep's cluster has). Jobs start in sweep order: the next one waits until the
running ones leave it room, in devices and on disk: a job starts only when its checkpoints and
export (``rlhf.plan.disk``) fit beside what the running jobs on the same filesystem have still to
write, so that each job's own start-of-run check, which sees only the free space of that moment, holds
for all of them together. A job larger than the whole cluster is recorded as failed without
running. Each job is built, and its hooks (MLflow child run) called, in the launcher's thread, as
Hydra's job bookkeeping (``HydraConfig``, the working directory) is per process; only the training
runs in the job's thread (so ``hydra.job.chdir=true`` is refused). Ctrl-C and SIGTERM stop only the launcher's thread: running jobs finish.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals

from rlhf.spec.runspec import RunSpec


def launch(hydra_context: Any, task_function: Any, config: Any, job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> list[JobReturn]:
    """The launcher's ``launch``: each job built in turn, run in a thread of its own once it fits."""
    import ray
    from omegaconf import open_dict

    from rlhf.sweep import PendingJob

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    returns: list[JobReturn] = []
    submitted: list[tuple[Future, JobReturn]] = []
    running: dict[Future, int] = {}  # a job's thread -> the devices it holds
    claims: dict[Future, DiskClaim] = {}  # a job's thread -> the disk it writes at its peak
    started_ray = False
    with ThreadPoolExecutor(max_workers=max(len(job_overrides), 1), thread_name_prefix="sweep-job") as pool:
        for i, overrides in enumerate(job_overrides):
            cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = initial_job_idx + i
            ret = run_job(hydra_context=hydra_context, task_function=task_function, config=cfg,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            returns.append(ret)
            pending = ret._return_value
            if not isinstance(pending, PendingJob):  # a job that failed to build: recorded already
                continue
            ctx = contextvars.copy_context()  # the hooks' per-job state (the MLflow parent) stays with it
            if not ctx.run(pending.start):  # the hooks: the sweep's Ray cluster is up after the first
                ret.return_value = pending.sweep.end(pending.job, pending.result)
                continue
            if pending.spec.mode == "run" and not ray.is_initialized():  # ray.address: joined once, here
                from rlhf.launch.cluster import init_ray

                started_ray = init_ray(pending.spec)
            capacity = float(ray.cluster_resources().get(pending.unit, 0.0)) if pending.devices else 0.0
            if pending.devices > capacity:
                ret.return_value = ctx.run(pending.fail, (
                    f"it needs {pending.devices} {pending.unit}s and the Ray cluster has {capacity:g}: "
                    + ("set ray.num_cpus (the worker slots) to at least that." if pending.unit == "CPU"
                       else "use a smaller placement or a larger Ray cluster.")))
                continue
            claim = DiskClaim.of(pending.spec)
            while running and (sum(running.values()) + pending.devices > capacity
                               or not claim.fits_beside([claims[f] for f in running])):
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    running.pop(f)
                    claims.pop(f)
            if not submitted:
                _resolve_lazy_imports()
            future = pool.submit(ctx.run, pending.run)
            running[future] = pending.devices
            claims[future] = claim
            submitted.append((future, ret))
    for future, ret in submitted:
        ret.return_value = future.result()
    if started_ray:
        from rlhf.launch import pool

        pool.drain()  # the jobs' idle worker processes (ray.reuse_workers)
        ray.shutdown()
    return returns


@dataclass(frozen=True)
class DiskClaim:
    """What a job writes under its run dir at its peak (``rlhf.plan.disk.need``), and where."""

    spec: RunSpec
    device: Optional[int]  # the filesystem (st_dev of the run dir's nearest existing parent)
    need: int  # bytes

    @classmethod
    def of(cls, spec: RunSpec) -> "DiskClaim":
        """The job's claim; none (0 bytes) where its need cannot be worked out: its own start-of-run
        check then says why, as a job's failure, not the sweep's."""
        from rlhf import storage
        from rlhf.plan import disk
        from rlhf.plan.memory import GB

        try:
            need = int(disk.need(spec).total * GB) if spec.mode == "run" else 0
        except Exception:  # noqa: BLE001 - e.g. a data file the step count could not read
            need = 0
        where = storage.nearest_existing(Path(spec.run_dir).expanduser())
        return cls(spec, where.stat().st_dev if where is not None else None, need)

    def left(self) -> int:
        """Bytes still to be written: the need less what the run dir holds now."""
        from rlhf import storage

        return max(0, self.need - storage.dir_bytes(Path(self.spec.run_dir).expanduser()))

    def fits_beside(self, others: Sequence["DiskClaim"]) -> bool:
        """The need fits in DISK_FIT_MARGIN of the room the job's own start-of-run check counts
        (``rlhf.plan.disk.available_bytes``) once the running jobs on the same filesystem have
        written what they still will (unknown room: it fits, as that check says)."""
        from rlhf.plan.disk import DISK_FIT_MARGIN, available_bytes

        if self.need == 0 or self.device is None:
            return True
        room = available_bytes(self.spec)
        if room is None:
            return True
        pending = sum(o.left() for o in others if o.device == self.device)
        return self.need <= DISK_FIT_MARGIN * (room - pending)


def _resolve_lazy_imports() -> None:
    """transformers resolves its top-level names on first use, and two threads doing that for the
    same name at once can fail (ImportError: cannot import name ...): the names a run's driver
    imports are resolved here, before any job's thread starts."""
    import transformers

    for name in ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "LlamaConfig", "LlamaForCausalLM",
                 "AutoModelForSequenceClassification"):
        getattr(transformers, name)
