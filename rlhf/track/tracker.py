"""Run tracking from the driver: the trackers of ``tracking.backend`` and a console line.

``Tracker`` fans each call out to every tracker the spec names (MLflow here; TensorBoard in
rlhf/track/tensorboard_run.py; W&B in rlhf/track/wandb_run.py), all fed the same params, metric
names and steps (a step's metrics at its number counted from 1, as on the console, in
metrics.jsonl and in the checkpoint names ``step_N``; 0 is before training). A tracker that
raises (its disk is full, its credentials are refused, its server is gone) is dropped with one
``warning:`` line and the run goes on with the others: metrics.jsonl in the run dir stays the
record.

MLflow:

* ``tracking.uri`` null: the project's store, one for every run and sweep started from one
  directory: a sqlite store ``sqlite:///<dir>/mlflow.db`` (created here, in the driver, before any
  worker could race on it) with artifacts in ``<dir>/mlartifacts``, where ``<dir>`` is
  ``$RLHF_TRACKING_DIR``, which ``rlhf-run`` sets to ``outputs/`` of the directory it was started
  in (before Hydra may change into the run dir) unless it is set already; without either (a run
  started from Python), ``outputs/`` of the working directory. It does not follow ``output_dir``.
* params: the flattened resolved config (``rlhf.spec.build.flatten(config_dict(spec))``) plus the
  derived batch plan, layout and ``auto`` decisions (``derived.*``); artifacts: ``spec.yaml`` and
  ``config.yaml``.
* metrics: one ``log_batch`` per step.
* several runs at once on one store: a sqlite store is created (its tables, the experiment) under a
  file lock beside it (``<db>.lock``, ``rlhf.run_lock.file_lock``), so only one process runs MLflow's
  schema set-up; every client call retries for up to two minutes while sqlite says "database is
  locked" (another run writing).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rlhf.paths import tracking_dir
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec
from rlhf.spec.schema import tracking_backends
from rlhf.track.params import (  # noqa: F401 - names the sweep and the tests import from here
    REDACTED,
    SECRET_WORDS,
    SWEEP_GROUP,
    SWEEP_PARENT,
    is_secret_key,
    redact,
    redact_url,
    typed_params,
)
from rlhf.track.params import string_params as _params  # MLflow's params (tests patch this name)


def default_tracking_uri() -> str:
    return f"sqlite:///{tracking_dir() / 'mlflow.db'}"


def _creation_lock(uri: str):
    """A file lock beside a local sqlite store (``sqlite:///<path>``); nothing for other stores."""
    import contextlib

    if not uri.startswith("sqlite:///"):
        return contextlib.nullcontext()
    from rlhf.run_lock import file_lock

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    return file_lock(str(db) + ".lock")


LOCKED_RETRY_S = 120.0


class Retrying:
    """An MlflowClient whose calls wait out sqlite's "database is locked" (another run's write)."""

    def __init__(self, client: Any):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            delay, deadline = 0.1, time.monotonic() + LOCKED_RETRY_S
            while True:
                try:
                    return attr(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - MlflowException wraps sqlalchemy's OperationalError
                    if "database is locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)

        return call


class MlflowRun:
    """The MLflow run of one training run (or, ``open_run=False``, only its experiment)."""

    name = "mlflow"

    def __init__(self, spec: RunSpec, run_dir: str, artifacts: tuple[str, ...] = (), open_run: bool = True):
        self.spec = spec
        self.run_id: Optional[str] = None
        self.uri: Optional[str] = None
        self.experiment_id: Optional[str] = None
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # after the import, which sets mlflow's level to INFO ("Creating initial MLflow database tables...")
        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow").setLevel(logging.WARNING)

        root = tracking_dir()
        if not spec.tracking.uri:
            root.mkdir(parents=True, exist_ok=True)
        self.uri = spec.tracking.uri or default_tracking_uri()
        with _creation_lock(self.uri):  # MLflow's schema set-up is not safe to run twice at once
            self.client = Retrying(MlflowClient(tracking_uri=self.uri))
            exp = self.client.get_experiment_by_name(spec.tracking.experiment)
            if exp is None:
                art = (root / "mlartifacts").as_uri() if not spec.tracking.uri else None
                try:
                    self.experiment_id = self.client.create_experiment(spec.tracking.experiment,
                                                                       artifact_location=art)
                except Exception:  # noqa: BLE001 - created concurrently (a store without the lock)
                    self.experiment_id = self.client.get_experiment_by_name(spec.tracking.experiment).experiment_id
            else:
                self.experiment_id = exp.experiment_id
        if not open_run:  # the experiment only (a sweep's parent run is made by rlhf.sweep)
            return
        run_dir_abs = str(Path(run_dir).resolve())
        if getattr(spec, "resume", None):  # a resumed run continues its own MLflow run
            old = self.client.search_runs([self.experiment_id], filter_string=f"tags.`rlhf.run_dir` = '{run_dir_abs}'",
                                          order_by=["attributes.start_time DESC"], max_results=1)
            if old:
                self.run_id = old[0].info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.set_tag(self.run_id, "rlhf.resumed", "true")
                return
        tags = {"rlhf.run_dir": run_dir_abs, "rlhf.algo": spec.algo.name, "rlhf.model_path": str(spec.model.path)}
        parent = SWEEP_PARENT.get()  # set by rlhf.sweep for each job of a sweep
        if parent:
            tags.update({"mlflow.parentRunId": parent[0], "rlhf.sweep_job": parent[1]})
        run = self.client.create_run(self.experiment_id, run_name=Path(run_dir).name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in _params(spec).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        for a in artifacts:
            self.client.log_artifact(self.run_id, a)
        # the Hydra overrides of the command line and the model path, as artifacts too
        self.client.log_text(self.run_id, "\n".join(getattr(spec, "overrides", ())) + "\n", "overrides.txt")
        self.client.log_text(self.run_id, str(spec.model.path) + "\n", "model_path.txt")

    def log_model_path(self, path: str) -> None:
        if self.run_id:
            self.client.set_tag(self.run_id, "rlhf.final_model", str(Path(path).resolve()))
            self.client.log_text(self.run_id, str(Path(path).resolve()) + "\n", "final_model_path.txt")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def log_artifact(self, path: str, folder: Optional[str] = None) -> None:
        if self.run_id:
            self.client.log_artifact(self.run_id, path, folder)

    def where(self) -> str:
        lines = [f"mlflow: run {self.run_id} in experiment {self.spec.tracking.experiment!r} at {redact_url(self.uri)}"]
        if self.uri.startswith("sqlite:") or self.uri.startswith("file:"):
            lines.append(f"        view it: mlflow ui --backend-store-uri {self.uri}")
        return "\n".join(lines)

    def finish(self, status: str) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status=status)


def _open_backend(name: str, spec: RunSpec, run_dir: str, artifacts: tuple[str, ...]) -> Any:
    if name == "mlflow":
        return MlflowRun(spec, run_dir, artifacts)
    if name == "tensorboard":
        from rlhf.track.tensorboard_run import TensorBoardRun

        return TensorBoardRun(spec, run_dir)
    from rlhf.track.wandb_run import WandbRun

    return WandbRun(spec, run_dir)


# the package each tracker needs, and how to get it
PACKAGES = {"tensorboard": ("tensorboardX", "pip install tensorboardX"), "wandb": ("wandb", "pip install 'rlhf[wandb]'")}


def _warn_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:200]}"


class Tracker:
    """Every tracker of ``tracking.backend`` for one training run (none: a no-op).

    Each call goes to each open tracker; one that raises is dropped (``dropped`` keeps why) with
    one ``warning:`` line through ``warn``, and the others go on. A tracker whose package is not
    installed stops the run before it starts (a UserError naming the install command)."""

    def __init__(self, spec: RunSpec, run_dir: str, artifacts: tuple[str, ...] = (), open_run: bool = True,
                 warn: Optional[Callable[[str], None]] = None):
        self.spec = spec
        self.names = tracking_backends(spec.tracking.backend)
        self.enabled = bool(self.names)
        self.warn = warn or _warn_stderr
        self.backends: list[Any] = []
        self.dropped: dict[str, str] = {}
        self.mlflow: Optional[MlflowRun] = None
        for name in self.names:
            if name in PACKAGES:
                import importlib.util

                module, install = PACKAGES[name]
                if importlib.util.find_spec(module) is None:
                    raise UserError(f"tracking.backend names {name}, but the {module} package is not installed. "
                                    f"Install it ({install}) or drop {name} from tracking.backend.")
        if not open_run:  # the experiment only (a sweep's parent run is made by rlhf.sweep): errors raise
            if "mlflow" in self.names:
                self.mlflow = MlflowRun(spec, run_dir, open_run=False)
            return
        for name in self.names:
            try:
                backend = _open_backend(name, spec, run_dir, artifacts)
            except Exception as e:  # noqa: BLE001 - any tracker's failure: drop it, keep training
                self._drop(name, "could not start", e)
                continue
            self.backends.append(backend)
            if name == "mlflow":
                self.mlflow = backend

    @classmethod
    def experiment_only(cls, spec: RunSpec, run_dir: str) -> "Tracker":
        """The MLflow client and experiment of ``spec.tracking``, without a run of its own."""
        return cls(spec, run_dir, open_run=False)

    # MLflow's run, for the sweep's parent/child runs and the tests
    @property
    def run_id(self) -> Optional[str]:
        return self.mlflow.run_id if self.mlflow else None

    @property
    def client(self) -> Any:
        return self.mlflow.client if self.mlflow else None

    @property
    def experiment_id(self) -> Optional[str]:
        return self.mlflow.experiment_id if self.mlflow else None

    @property
    def uri(self) -> Optional[str]:
        return self.mlflow.uri if self.mlflow else None

    def _drop(self, name: str, doing: str, e: BaseException) -> None:
        for b in self.backends:
            if b.name == name:  # keep what it has written so far (a writer's buffer), if it still can
                try:
                    b.finish("FAILED")
                except Exception:  # noqa: BLE001
                    pass
        self.backends = [b for b in self.backends if b.name != name]
        if name == "mlflow":
            self.mlflow = None
        self.dropped[name] = _reason(e)
        self.warn(f"tracking: {name} {doing} ({_reason(e)}); training goes on without it "
                  f"(metrics.jsonl in the run dir has every step)")

    def _each(self, doing: str, call: Callable[[Any], None]) -> None:
        for b in list(self.backends):
            try:
                call(b)
            except Exception as e:  # noqa: BLE001
                self._drop(b.name, doing, e)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.backends:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._each("failed to log metrics", lambda b: b.log(step, clean))

    def log_model_path(self, path: str) -> None:
        """Where the run's final HF export is (``final/hf``): a tag and an artifact."""
        self._each("failed to record the model path", lambda b: b.log_model_path(path))

    def log_artifact(self, path: str, folder: Optional[str] = None) -> None:
        """A file of the run (the report) in the trackers that keep files (MLflow, W&B)."""
        self._each("failed to store an artifact",
                   lambda b: b.log_artifact(path, folder) if hasattr(b, "log_artifact") else None)

    def where(self) -> str:
        if not self.names:
            return "tracking: off (tracking.backend=none)"
        lines = []
        for b in self.backends:
            try:
                lines.append(b.where())
            except Exception:  # noqa: BLE001 - a line of text must not end the run
                lines.append(f"{b.name}: (unknown)")
        lines += [f"{n}: off ({why})" for n, why in self.dropped.items()]
        return "\n".join(lines)

    def finish(self, status: str = "FINISHED") -> None:
        for b in self.backends:
            try:
                b.finish(status)
            except Exception:  # noqa: BLE001 - the run has ended; its tracker's goodbye must not fail it
                pass
        if self.mlflow is not None:
            self.run_id_done = self.mlflow.run_id


class Console:
    """A live progress line (rich on a terminal), plain lines otherwise, or nothing (``tracking.console``)."""

    def __init__(self, mode: str, total_steps: int, stream=None):
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.mode = "plain" if mode == "verbose" else mode  # verbose: the workers' output too (worker_logs)
        if mode == "rich" and not self.stream.isatty():
            self.mode = "plain"
        self._progress = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    @staticmethod
    def summary(m: dict[str, float]) -> str:
        if "reward/mean" not in m and "train/loss" in m:  # sft / rm / dpo steps
            parts = [f"loss {m['train/loss']:.4f}"]
            if "train/accuracy" in m:
                parts.append(f"acc {m['train/accuracy']:.3f}")
            if "time/elapsed" in m:
                parts.append(f"{m['time/elapsed']:.1f} s")
            return " · ".join(parts)
        parts = [f"reward {m.get('reward/mean', float('nan')):.3f}"]
        if "kl/mean" in m:
            parts.append(f"kl {m['kl/mean']:.4f}")
        if "throughput/tokens_per_s" in m:
            parts.append(f"{m['throughput/tokens_per_s']:.0f} tok/s")
        if "time/step" in m:
            parts.append(f"{m['time/step']:.2f} s/step")
        return " · ".join(parts)

    def status(self, text: str, run_dir: Optional[str] = None) -> "contextlib.AbstractContextManager[None]":
        """While the block runs: ``text`` and the seconds so far on the live line (rich), with the
        newest line of the workers' logs under ``run_dir`` (what they are doing: loading weights,
        capturing CUDA graphs); plain: ``text`` once; none: nothing."""
        import threading

        if self.mode == "none":
            return contextlib.nullcontext()
        if self._progress is None:
            self.print(text)
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def live():
            from rlhf.track.worker_logs import latest_line

            stop, t0 = threading.Event(), time.monotonic()

            def tick():
                while not stop.wait(0.5):
                    now = latest_line(run_dir) if run_dir else ""
                    self._progress.update(self._task, info=f"{text} {time.monotonic() - t0:.0f} s"
                                                            + (f" · {now}" if now else ""))

            thread = threading.Thread(target=tick, name="rlhf-console-status", daemon=True)
            thread.start()
            try:
                yield
            finally:
                stop.set()
                thread.join()
                self._progress.update(self._task, info="")

        return live()

    def set_total(self, total_steps: int) -> None:
        """Loops that learn their step count from the data (sft, rm, dpo) set it here."""
        self.total = total_steps
        if self._progress is not None:
            self._progress.update(self._task, total=total_steps)

    def step(self, step: int, m: dict[str, float]) -> None:
        """Step ``step`` (counted from 1) is done."""
        if self.mode == "none":
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=self.summary(m))
        else:
            print(f"step {step}/{self.total} · {self.summary(m)}", file=self.stream, flush=True)

    def print(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
