"""Sweeps: ``rlhf-run -m algo.lr=1e-6,5e-7 algo=grpo,rloo`` runs one job per combination.

The sweep is a Hydra multirun of the ``rlhf-run`` app (rlhf/hydra_app.py): Hydra's sweeper picks
the jobs and its launcher runs them, each in its own directory ``<hydra.sweep.dir>/<n>``. The
default (basic sweeper and launcher) runs the grid of comma-separated values one job after another
in this process. ``hydra/sweeper=optuna`` searches ``hydra.sweeper.params`` instead (recipe
grpo_tiny_optuna): each job returns ``tracking.objective`` (its mean over the last fifth of the
steps) to the sweeper, and the best trial is reported at the end. ``hydra/launcher=...`` sends the
jobs elsewhere (submitit_slurm: a SLURM cluster; ``parallel``: the jobs that fit side by side on
the Ray cluster's devices run at the same time, rlhf/sweep_parallel.py). Each job builds its spec exactly like a single run
and calls ``rlhf.run.execute(spec)``.

- Before any job starts, every job's config is composed once (a search: the config at each bound
  and choice of every searched key): a sweep whose definition is broken (an unknown option or
  key, a wrong type in one of its values) stops with exit code 2 and every broken job named,
  instead of failing halfway through.
- A job that fails later (its spec does not validate, or training raises) is recorded and the
  sweep goes on. The summary lists each job; the exit code is 0 only if every job succeeded.
  ``<sweep dir>/sweep_results.yaml`` keeps the same summary.
- ``-m ... --plan`` prints each job's plan and starts no Hydra machinery at all.

Hooks: ``SweepHooks`` is called at the start and end of the sweep and of each job. ``default_hooks``:
``RaySweepHooks`` (one Ray cluster for every job, shut down after the last) and ``MlflowSweepHooks``
(one MLflow parent run per sweep, a child run per job, via ``rlhf.track.tracker.SWEEP_PARENT``; a failed job's child run is FAILED; the
parent holds each job's objective and, after a search, the best parameters).
"""

from __future__ import annotations

import itertools
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf.config import build_spec, check_group_choices, compose, parse_overrides, stamped, unique_dir
from rlhf.config.exits import EXIT_USER
from rlhf.run import execute
from rlhf.spec.errors import SpecError
from rlhf.spec.runspec import RunSpec

SWEEP_CPU_SLOTS = 64  # the worker slots of a CPU sweep's Ray cluster without ray.num_cpus


@dataclass
class Job:
    index: int
    overrides: list[str]


@dataclass
class JobResult:
    index: int
    overrides: list[str]
    status: str  # ok | failed
    exit_code: int
    error: Optional[str] = None
    output_dir: Optional[str] = None
    objective: Optional[float] = None  # tracking.objective of a finished job
    started: Optional[float] = None  # time.time() when the job began executing, and when it ended
    ended: Optional[float] = None


class SweepHooks:
    """Called around a sweep and each of its jobs. Subclass and return it from ``default_hooks``.

    The MLflow parent/child runs go here: ``sweep_start`` opens the parent run, ``job_start`` a
    child run (tagged with the job's overrides), ``job_end`` closes it with the job's status.
    """

    def sweep_start(self, sweep_dir: Optional[str], jobs: Sequence[Job]) -> None:
        pass

    def job_start(self, job: Job, spec: RunSpec) -> None:
        pass

    def job_end(self, job: Job, result: JobResult) -> None:
        pass

    def sweep_end(self, sweep_dir: Optional[str], results: Sequence[JobResult]) -> None:
        pass


class RaySweepHooks(SweepHooks):
    """One Ray cluster for the whole sweep: started before the first job that runs (unless Ray is
    already up or ``ray.address`` joins one), shut down after the last. Each job's cluster then
    only kills its own actors and placement groups (``Cluster.shutdown``)."""

    def __init__(self) -> None:
        self.started = False

    def job_start(self, job: Job, spec: RunSpec) -> None:
        if spec.mode != "run" or spec.ray.address:
            return
        from rlhf.launch.cluster import init_ray

        # on CPU, unless ray.num_cpus sets the worker slots (the parallel launcher fits jobs into
        # them), room for any job's layout: the first job's cluster serves them all
        if init_ray(spec, min_cpu_slots=SWEEP_CPU_SLOTS):
            self.started = True

    def sweep_end(self, sweep_dir: Optional[str], results: Sequence[JobResult]) -> None:
        if self.started:
            import ray

            from rlhf.launch import pool

            pool.drain()  # the jobs' idle worker processes (ray.reuse_workers)
            ray.shutdown()
            self.started = False


class MlflowSweepHooks(SweepHooks):
    """One MLflow parent run per sweep and a child run per job (``mlflow.parentRunId``).

    The parent is opened at the first job with ``tracking.backend=mlflow`` (its tracking URI and
    experiment); each job's own run (rlhf.track.Tracker) becomes its child. A job that failed
    before its run existed (its spec did not build) still gets a child run, marked FAILED."""

    def __init__(self) -> None:
        self.client = None
        self.parent_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.sweep_dir: Optional[str] = None
        self.n_jobs = 0

    def sweep_start(self, sweep_dir: Optional[str], jobs: Sequence[Job]) -> None:
        self.sweep_dir, self.n_jobs = sweep_dir, len(jobs)

    def _open(self, spec: RunSpec) -> None:
        from rlhf.track import Tracker

        t = Tracker.experiment_only(spec, spec.output_dir)
        self.client, self.experiment_id = t.client, t.experiment_id
        name = f"sweep {Path(self.sweep_dir).name}" if self.sweep_dir else "sweep"
        run = self.client.create_run(self.experiment_id, run_name=name, tags={
            "rlhf.sweep_dir": str(Path(self.sweep_dir).resolve()) if self.sweep_dir else "",
            "rlhf.sweep_jobs": str(self.n_jobs)})
        self.parent_id = run.info.run_id

    def job_start(self, job: Job, spec: RunSpec) -> None:
        from rlhf.spec.schema import tracking_backends
        from rlhf.track.tracker import SWEEP_PARENT

        if spec.mode != "run" or "mlflow" not in tracking_backends(spec.tracking.backend):
            return
        if self.parent_id is None:
            self._open(spec)
        SWEEP_PARENT.set((self.parent_id, str(job.index)))  # the job's Tracker makes its run a child

    def job_end(self, job: Job, result: JobResult) -> None:
        from rlhf.track.tracker import SWEEP_PARENT

        SWEEP_PARENT.set(None)
        if self.parent_id is None:
            return
        self.client.log_metric(self.parent_id, "sweep/job_ok", 1.0 if result.status == "ok" else 0.0, step=job.index)
        if result.objective is not None:
            self.client.log_metric(self.parent_id, "sweep/objective", result.objective, step=job.index)
        if result.status == "ok" or self._child(job) is not None:
            return
        run = self.client.create_run(self.experiment_id, run_name=f"job {job.index}", tags={
            "mlflow.parentRunId": self.parent_id, "rlhf.sweep_job": str(job.index),
            "rlhf.overrides": " ".join(job.overrides)[:5000], "rlhf.error": (result.error or "")[:5000]})
        self.client.set_terminated(run.info.run_id, status="FAILED")

    def _child(self, job: Job):
        runs = self.client.search_runs([self.experiment_id], filter_string=(
            f"tags.`mlflow.parentRunId` = '{self.parent_id}' and tags.`rlhf.sweep_job` = '{job.index}'"))
        return runs[0] if runs else None

    def sweep_end(self, sweep_dir: Optional[str], results: Sequence[JobResult]) -> None:
        if self.parent_id is None:
            return
        failed = sum(r.status != "ok" for r in results)
        self.client.set_tag(self.parent_id, "rlhf.sweep_failed", str(failed))
        self.client.log_metric(self.parent_id, "sweep/failed_jobs", float(failed))
        best = best_trial(sweep_dir, results)
        if best is not None:
            params, value, index = best
            for k, v in params.items():
                self.client.log_param(self.parent_id, f"best.{k}", v)
            self.client.log_metric(self.parent_id, "sweep/best_objective", value)
            if index is not None:
                self.client.set_tag(self.parent_id, "rlhf.best_job", str(index))
        self.client.set_terminated(self.parent_id, status="FINISHED")


def default_hooks() -> list[SweepHooks]:
    """Every sweep: one Ray cluster for all jobs, an MLflow parent run with a child per job, a W&B group."""
    from rlhf.track.sweep_group import TrackerSweepHooks  # rlhf/track: the W&B group of each job

    return [RaySweepHooks(), MlflowSweepHooks(), TrackerSweepHooks()]


# ----------------------------------------------------------------------------- jobs


def is_hydra_override(o: str) -> bool:
    """``hydra.*`` keys and ``hydra/*`` groups: settings of the sweep itself, not of its jobs."""
    key = o.lstrip("+~").split("=", 1)[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def expand(overrides: Sequence[str]) -> list[Job]:
    """The jobs of a grid sweep, in the order Hydra's basic sweeper runs them: the cartesian product
    of the comma-separated values, the first key varying slowest; a key given twice keeps its first
    place and its last value. Raises SpecError for a sweep a grid cannot enumerate (an interval)."""
    parsed = parse_overrides([o for o in overrides if not is_hydra_override(o)])
    bad = [ov.input_line for ov in parsed if ov.is_sweep_override() and not ov.is_discrete_sweep()]
    if bad:
        raise SpecError([f"{b}: the basic sweeper runs lists (a,b,c) and range(); an interval needs a search: "
                         f"rlhf-run -m hydra/sweeper=optuna {b}" for b in bad])
    choices: dict[str, list[str]] = {}  # insertion-ordered: a repeated key keeps its first place
    for ov in parsed:
        key = ov.get_key_element()
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]
    return [Job(i, list(combo)) for i, combo in enumerate(itertools.product(*choices.values()))]


def sweeper_of(overrides: Sequence[str], config_dir: Optional[str], config_name: str) -> tuple[str, Any]:
    """(the sweeper's class path, the composed base config) with the sweep's fixed overrides."""
    from omegaconf import OmegaConf

    fixed = [ov.input_line for ov in parse_overrides(overrides) if not ov.is_sweep_override()]
    cfg = compose(fixed, config_dir=config_dir, config_name=config_name)
    return str(OmegaConf.select(cfg, "hydra.sweeper._target_", default="")), cfg


def search_jobs(overrides: Sequence[str], base: Any) -> list[Job]:
    """The jobs that stand for a search (Optuna): the fixed overrides, with each searched key at
    each end of its interval or range and at each of its choices (the other keys at their first)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(base, "hydra.sweeper.params", default=None)
    params = OmegaConf.to_container(node) if node is not None else {}
    lines = [f"{k}={v}" for k, v in params.items()] + [o for o in overrides if not is_hydra_override(o)]
    fixed, searched = [], {}
    for ov in parse_overrides(lines):
        key = ov.get_key_element()
        if not ov.is_sweep_override():
            fixed.append(f"{key}={ov.get_value_element_as_str()}")
            continue
        sweep = ov.value()
        if hasattr(sweep, "start") and hasattr(sweep, "end") and not hasattr(sweep, "step"):  # interval
            values = [sweep.start, sweep.end]
        elif hasattr(sweep, "list"):  # choice
            values = list(sweep.list)
        else:  # range
            values = list(ov.sweep_iterator())
            values = values[:1] + values[-1:]
        searched[key] = [f"{key}={v}" for v in values]
    firsts = [v[0] for v in searched.values()]
    combos = [firsts] + [[*firsts[:i], alt, *firsts[i + 1:]] for i, vs in enumerate(searched.values()) for alt in vs[1:]]
    return [Job(i, [*fixed, *combo]) for i, combo in enumerate(combos)]


def preflight(jobs: Sequence[Job], config_dir: Optional[str], config_name: str,
              settings: Sequence[str] = ()) -> list[Any]:
    """Compose every job's config (with the sweep's ``hydra`` settings); raise SpecError naming
    each job that does not compose."""
    problems, configs = [], []
    for job in jobs:
        try:
            if config_dir is None:
                check_group_choices(job.overrides)
            configs.append(compose([*job.overrides, *settings], config_dir=config_dir, config_name=config_name))
        except SpecError as e:
            for p in e.problems:
                problems.append(f"job #{job.index} ({' '.join(job.overrides)}): {p}")
    if problems:
        problems.append(f"the sweep did not start: fix the jobs above ({len(jobs)} jobs in all).")
        raise SpecError(problems)
    return configs


def objective(output_dir: str, metric: str) -> Optional[float]:
    """``metric``'s mean over the last fifth (at least one) of the rows of metrics.jsonl that have it."""
    import json
    import math

    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    values = []
    for line in path.read_text().splitlines():
        try:
            v = json.loads(line).get(metric)
        except ValueError:  # a line cut short by a crash
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            values.append(float(v))
    if not values:
        return None
    tail = values[-max(1, len(values) // 5):]
    return sum(tail) / len(tail)


def best_trial(sweep_dir: Optional[str], results: Sequence[JobResult]) -> Optional[tuple[dict, float, Optional[int]]]:
    """(parameters, objective, job index) of a search's best trial, from the sweeper's
    optimization_results.yaml; None for a grid sweep."""
    if not sweep_dir or not (Path(sweep_dir) / "optimization_results.yaml").is_file():
        return None
    import yaml

    found = yaml.safe_load((Path(sweep_dir) / "optimization_results.yaml").read_text()) or {}
    if "best_params" not in found:
        return None
    params = {str(k): v for k, v in found["best_params"].items()}
    value = float(found["best_value"])
    index = next((r.index for r in results if r.objective == value
                  and all(f"{k}={v}" in r.overrides for k, v in params.items())), None)
    if index is None:
        index = next((r.index for r in results if r.objective == value), None)
    return params, value, index


# ----------------------------------------------------------------------------- one job


class _Sweep:
    """State of one running sweep, shared with the Hydra task function.

    ``parallel`` (``hydra/launcher=parallel``): ``run_job`` builds the job and returns it as a
    ``PendingJob`` for the launcher (rlhf/sweep_parallel.py) to run when the cluster has room."""

    def __init__(self, jobs: Sequence[Job], hooks: Sequence[SweepHooks], config_dir: Optional[str],
                 parallel: bool = False):
        import threading

        self.jobs = {tuple(j.overrides): j for j in jobs}  # a job of a search's trials, by its overrides
        self.by_index = {j.index: j for j in jobs}  # two identical jobs of a grid are two jobs
        self.hooks = list(hooks)
        self.config_dir = config_dir
        self.parallel = parallel
        self.results: list[JobResult] = []
        self.sweep_dir: Optional[str] = None
        self.lock = threading.Lock()  # hooks and results: jobs of the parallel launcher end in threads

    def run_job(self, cfg: Any) -> Any:
        """Hydra's task function: build this job's spec like a single run, then execute it."""
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        hc = HydraConfig.get()
        overrides = list(hc.overrides.task)
        key = tuple(o for o in overrides if not is_hydra_override(o))
        job = self.by_index.get(int(hc.job.num))  # the basic sweeper numbers the grid's jobs as it is expanded
        if job is None or tuple(job.overrides) != key:
            job = self.jobs.get(key) or Job(int(hc.job.num), overrides)
        out = str(hc.runtime.output_dir)
        if self.sweep_dir is None:
            self.sweep_dir = str(Path(out).parent)
            for h in self.hooks:
                h.sweep_start(self.sweep_dir, list(self.jobs.values()))
        result = JobResult(job.index, overrides, "failed", 1, output_dir=out)
        try:
            with open_dict(cfg):
                cfg.output_dir = out  # each job in its own directory, whatever the config says
            choices = dict(hc.runtime.choices)
            spec = build_spec(cfg, overrides, plan=False, config_dir=self.config_dir, choices=choices)
        except Exception as e:  # noqa: BLE001 - recorded like any failed job
            self._failed(job, result, e)
            return self.end(job, result)
        pending = PendingJob(self, job, spec, result)
        if self.parallel:
            return pending
        return pending.run() if pending.start() else self.end(job, result)

    def _failed(self, job: Job, result: JobResult, e: BaseException) -> None:
        out = result.output_dir or "."
        if isinstance(e, SpecError):
            result.exit_code, result.error = EXIT_USER, " ".join(e.problems)
            print(e.render(), file=sys.stderr)
            return
        result.error = f"{type(e).__name__}: {e}"
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "error.txt").write_text("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        print(f"error: job #{job.index} failed: {result.error} (traceback in {out}/error.txt)", file=sys.stderr)

    def end(self, job: Job, result: JobResult) -> Optional[float]:
        """Record a finished (or failed) job; its value for the sweeper (None: a failed trial)."""
        with self.lock:
            self.results.append(result)
            for h in self.hooks:
                h.job_end(job, result)
        return result.objective if result.status == "ok" else None


@dataclass
class PendingJob:
    """A built job: ``start`` calls the hooks' ``job_start`` (Ray up, the MLflow parent open),
    ``run`` executes it and records the result. The parallel launcher calls ``start`` in its own
    thread and ``run`` in the job's thread (in a copy of the context ``start`` ran in)."""

    sweep: _Sweep
    job: Job
    spec: RunSpec
    result: JobResult

    @property
    def devices(self) -> int:
        """Devices (GPUs; on CPU worker slots, i.e. Ray CPUs) the job's placement groups take."""
        return self.spec.layout.total_devices if self.spec.mode == "run" else 0

    @property
    def unit(self) -> str:
        return "CPU" if self.spec.device == "cpu" else "GPU"

    def start(self) -> bool:
        try:
            with self.sweep.lock:
                for h in self.sweep.hooks:
                    h.job_start(self.job, self.spec)
            return True
        except Exception as e:  # noqa: BLE001
            self.sweep._failed(self.job, self.result, e)
            return False

    def fail(self, message: str) -> Optional[float]:
        """Record the job as failed without running it."""
        self.result.error = message
        print(f"error: job #{self.job.index}: {message}", file=sys.stderr)
        return self.sweep.end(self.job, self.result)

    def run(self) -> Optional[float]:
        import time

        result, out = self.result, self.result.output_dir
        result.started = time.time()
        try:
            code = execute(self.spec)
            result.exit_code = int(code or 0)
            result.status = "ok" if result.exit_code == 0 else "failed"
            if result.exit_code:
                result.error = f"exit code {result.exit_code}"
            elif self.spec.mode == "run":
                result.objective = objective(out, self.spec.tracking.objective)
        except Exception as e:  # noqa: BLE001 - a crashed job: recorded, and the sweep goes on
            self.sweep._failed(self.job, result, e)
        result.ended = time.time()
        return self.sweep.end(self.job, result)


def _run_hydra_multirun(sweep: _Sweep, overrides: Sequence[str], config_dir: Optional[str], config_name: str) -> None:
    from rlhf.hydra_app import hydra_overrides, run_app

    code = run_app(sweep.run_job, ["--multirun", *hydra_overrides(config_dir), *overrides],
                   config_dir=config_dir, config_name=config_name)
    if code not in (0, None):  # Hydra stopped on its own error (it has printed it)
        raise SpecError([f"the sweep stopped: Hydra exited with code {code} (see above)."])


def summarize(results: Sequence[JobResult], sweep_dir: Optional[str]) -> str:
    ok = sum(r.status == "ok" for r in results)
    lines = [f"sweep: {len(results)} jobs, {ok} ok, {len(results) - ok} failed" + (f" ({sweep_dir})" if sweep_dir else "")]
    for r in results:
        line = f"  #{r.index} {r.status:<6} {' '.join(r.overrides) or '(defaults)'}"
        if r.objective is not None:
            line += f"  objective {r.objective:.4g}"
        if r.error:
            line += f"  — {r.error}"
        lines.append(line)
    best = best_trial(sweep_dir, results)
    if best is not None:
        params, value, index = best
        lines.append(f"best: {' '.join(f'{k}={v}' for k, v in params.items())}  objective {value:.4g}"
                     + (f" (job #{index})" if index is not None else ""))
    return "\n".join(lines)


def multirun_main(args: Any, hooks: Optional[Sequence[SweepHooks]] = None) -> int:
    """``rlhf-run -m ...``: returns the exit code (0 all ok, 1 a job failed, 2 a broken sweep)."""
    hooks = default_hooks() if hooks is None else list(hooks)
    if args.config_dir is None:
        check_group_choices(args.overrides, allow_sweep=True)
    target, base = sweeper_of(args.overrides, args.config_dir, args.config_name)
    settings = [o for o in args.overrides if is_hydra_override(o)]
    if target.endswith("BasicSweeper"):
        jobs = expand(args.overrides)
    else:  # a search: its trials are picked as it goes; check the corners of its space instead
        jobs = search_jobs(args.overrides, base)
    configs = preflight(jobs, args.config_dir, args.config_name, settings)

    if args.plan:
        results = []
        for job, cfg in zip(jobs, configs):
            print(f"=== job #{job.index}: {' '.join(job.overrides) or '(defaults)'}")
            try:
                spec = build_spec(cfg, job.overrides, plan=True, config_dir=args.config_dir)
                code = execute(spec)
                results.append(JobResult(job.index, job.overrides, "ok" if code == 0 else "failed", code))
            except SpecError as e:
                print(e.render())
                results.append(JobResult(job.index, job.overrides, "failed", EXIT_USER, " ".join(e.problems)))
        print(summarize(results, None))
        return 0 if all(r.status == "ok" for r in results) else 1

    from omegaconf import OmegaConf

    launcher = str(OmegaConf.select(base, "hydra.launcher._target_", default=""))
    parallel = launcher.endswith(".ParallelLauncher")
    if parallel and OmegaConf.select(base, "hydra.job.chdir", default=False):
        raise SpecError(["hydra/launcher=parallel runs the jobs side by side in one process, which has one "
                         "working directory: drop hydra.job.chdir=true."])
    sweep = _Sweep(jobs, hooks, args.config_dir, parallel=parallel)
    overrides = list(args.overrides)
    if not any(o.split("=", 1)[0].lstrip("+") == "hydra.sweep.dir" for o in overrides):
        # Hydra's default (multirun/<date>/<time>) is the same for two sweeps started in the same
        # second, and so would be their jobs' run dirs: a dir of its own for this sweep
        overrides.append(f"hydra.sweep.dir={unique_dir(stamped('multirun'), claim=True)}")
    _run_hydra_multirun(sweep, overrides, args.config_dir, args.config_name)
    sweep.results.sort(key=lambda r: r.index)  # the parallel launcher's jobs end in any order
    if sweep.sweep_dir:
        import yaml

        Path(sweep.sweep_dir).mkdir(parents=True, exist_ok=True)
        (Path(sweep.sweep_dir) / "sweep_results.yaml").write_text(
            yaml.safe_dump([asdict(r) for r in sweep.results], sort_keys=False)
        )
    for h in hooks:
        h.sweep_end(sweep.sweep_dir, sweep.results)
    print(summarize(sweep.results, sweep.sweep_dir))
    return 0 if sweep.results and all(r.status == "ok" for r in sweep.results) else 1
