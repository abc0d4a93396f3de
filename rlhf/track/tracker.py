"""Run tracking from the driver: MLflow params/metrics/artifacts and a console line.

* ``tracking.uri`` null: a sqlite store ``sqlite:///<output root>/mlflow.db`` (created here, in
  the driver, before any worker could race on it) with artifacts in ``<output root>/mlartifacts``.
  The output root is the nearest ancestor of the run dir named ``outputs``, else the run dir's
  parent.
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

import contextvars
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rlhf.spec.runspec import RunSpec


def output_root(run_dir: str) -> Path:
    p = Path(run_dir).resolve()
    for parent in [p, *p.parents]:
        if parent.name == "outputs":
            return parent
    return p.parent


def default_tracking_uri(run_dir: str) -> str:
    return f"sqlite:///{output_root(run_dir) / 'mlflow.db'}"


SECRET_WORDS = ("token", "secret", "password", "passwd", "api_key", "apikey", "credential", "private_key",
                "authorization", "auth_header")
REDACTED = "***"
# (MLflow parent run id, job index) of the sweep job running in this context: its run is a child.
# A context variable, not the environment: jobs of the parallel launcher run in threads side by side.
SWEEP_PARENT: contextvars.ContextVar[Optional[tuple[str, str]]] = contextvars.ContextVar("rlhf_sweep_parent", default=None)


def is_secret_key(key: str) -> bool:
    """A config key whose value must not be logged (``*token*``, ``*secret*``, ``*password*``,
    ``*api_key*`` ...); ``max_prompt_tokens`` and the like are counts, not secrets."""
    leaf = key.rsplit(".", 1)[-1].lower()
    if not any(w in leaf for w in SECRET_WORDS):
        return False
    if "token" in leaf and not any(w in leaf for w in SECRET_WORDS if w != "token"):
        return not (leaf.endswith("tokens") or "token_id" in leaf or leaf.startswith(("pad_", "eos_", "bos_"))
                    or leaf.startswith(("max_", "min_", "num_", "n_")))
    return True


def redact_url(value: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host``; ``?token=...`` query values too."""
    import re

    value = re.sub(r"(://[^/:@\s]+):[^/@\s]+@", r"\1:" + REDACTED + "@", value)
    return re.sub(r"((?:token|key|secret|password|sig|signature)=)[^&\s,\]']+", r"\1" + REDACTED, value,
                  flags=re.IGNORECASE)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if is_secret_key(k) and v not in (None, "", "None") else
                redact_url(v) if isinstance(v, str) else v) for k, v in params.items()}


def _params(spec: RunSpec) -> dict[str, str]:
    from rlhf.spec.build import config_dict, flatten, to_dict

    params = flatten(config_dict(spec))
    params.update(flatten({"batch": to_dict(spec.batch)}, "derived."))
    params["derived.roles"] = ",".join(spec.roles)
    params["derived.rollout_engine"] = spec.rollout_engine
    params.update({f"derived.{d.key}": d.value for d in getattr(spec, "auto", ())})  # what auto chose
    return redact({k: str(v)[:6000] for k, v in params.items()})


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


class Tracker:
    """MLflow run of one training run (``tracking.backend=none``: a no-op)."""

    def __init__(self, spec: RunSpec, run_dir: str, artifacts: tuple[str, ...] = (), open_run: bool = True):
        self.spec = spec
        self.enabled = spec.tracking.backend == "mlflow"
        self.run_id: Optional[str] = None
        self.uri: Optional[str] = None
        self.experiment_id: Optional[str] = None
        if not self.enabled:
            return
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import logging

        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        root = output_root(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.uri = spec.tracking.uri or default_tracking_uri(run_dir)
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

    @classmethod
    def experiment_only(cls, spec: RunSpec, run_dir: str) -> "Tracker":
        """The client and experiment of ``spec.tracking``, without a run of its own."""
        return cls(spec, run_dir, open_run=False)

    def log_model_path(self, path: str) -> None:
        """Where the run's final HF export is (``final/hf``): a tag and an artifact."""
        if self.enabled and self.run_id:
            self.client.set_tag(self.run_id, "rlhf.final_model", str(Path(path).resolve()))
            self.client.log_text(self.run_id, str(Path(path).resolve()) + "\n", "final_model_path.txt")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def where(self) -> str:
        if not self.enabled:
            return "tracking: off (tracking.backend=none)"
        lines = [f"mlflow: run {self.run_id} in experiment {self.spec.tracking.experiment!r} at {redact_url(self.uri)}"]
        if self.uri.startswith("sqlite:") or self.uri.startswith("file:"):
            lines.append(f"        view it: mlflow ui --backend-store-uri {self.uri}")
        return "\n".join(lines)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self.run_id:
            try:
                self.client.set_terminated(self.run_id, status=status)
            except Exception:  # noqa: BLE001
                pass
            self.run_id_done = self.run_id


class Console:
    """A live progress line (rich on a terminal), plain lines otherwise, or nothing."""

    def __init__(self, mode: str, total_steps: int, stream=None):
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.mode = mode
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

    def set_total(self, total_steps: int) -> None:
        """Loops that learn their step count from the data (sft, rm, dpo) set it here."""
        self.total = total_steps
        if self._progress is not None:
            self._progress.update(self._task, total=total_steps)

    def step(self, step: int, m: dict[str, float]) -> None:
        if self.mode == "none":
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, info=self.summary(m))
        else:
            print(f"step {step + 1}/{self.total} · {self.summary(m)}", file=self.stream, flush=True)

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
