"""Weights & Biases: one W&B run per training run, in ``<run dir>/wandb``.

* mode: ``tracking.wandb.mode``, else ``WANDB_MODE``, else online. Offline writes
  ``<run dir>/wandb/offline-run-*`` for ``wandb sync`` later; online without an API key fails at
  start (W&B's own message), and the run goes on without W&B (rlhf.track.tracker.Tracker).
* project ``tracking.wandb.project`` or ``tracking.experiment``; the run's name is the run dir's;
  a sweep's jobs share the group ``sweep <date>/<time>`` (the sweep dir's last two parts; rlhf.track.sweep_group sets it per job).
* config: the flattened config with its types plus ``derived.*``, secrets redacted — the keys of
  MLflow's params, nested at the dots.
* metrics: ``run.log(metrics, step=step)``, the names and steps MLflow gets.
* W&B prints nothing (``silent``) and leaves stdout alone (``console="off"``): the console is the
  run's own, and every worker's output is in its log file.
* resume: the W&B run id is kept in ``<run dir>/wandb/rlhf_run_id``; a resumed run continues it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf.spec.runspec import RunSpec


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "a.c": 2}`` -> ``{"a": {"b": 1, "c": 2}}`` (a key that is both a value and a
    prefix keeps the value under its full dotted name)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node, parts = out, key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                node = None
                break
            node = nxt
        if node is None or isinstance(node.get(parts[-1]), dict):
            out[key] = value
        else:
            node[parts[-1]] = value
    return out


class WandbRun:
    name = "wandb"

    def __init__(self, spec: RunSpec, run_dir: str):
        import wandb

        from rlhf.track.params import SWEEP_GROUP, typed_params

        w = spec.tracking.wandb
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "rlhf_run_id"
        resume_id = id_file.read_text().strip() if getattr(spec, "resume", None) and id_file.is_file() else None
        sweep = SWEEP_GROUP.get()
        group = "sweep " + "/".join(Path(sweep[0]).parts[-2:]) if sweep else None  # multirun/<date>/<time>
        name = f"{Path(sweep[0]).name}/{sweep[1]}" if sweep else self.run_dir.name
        # WANDB_MODE read here, per run: W&B's own read happens once per process (a sweep's first job)
        mode = w.mode or os.environ.get("WANDB_MODE") or None
        settings = wandb.Settings(console="off", silent=True)
        self.run = wandb.init(
            project=w.project or spec.tracking.experiment, entity=w.entity, mode=mode, group=group,
            job_type=spec.algo.kind, name=name, dir=str(self.run_dir), tags=[spec.algo.name, *w.tags],
            config=nest(typed_params(spec)), id=resume_id, resume="allow" if resume_id else None,
            settings=settings, reinit="create_new")
        id_file.write_text(self.run.id + "\n")
        self.offline = bool(self.run.settings._offline)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_model_path(self, path: str) -> None:
        self.run.summary["final_model"] = str(Path(path).resolve())

    def log_artifact(self, path: str, folder: str | None = None) -> None:
        """A copy in the run's files folder, which W&B uploads with the run (``wandb.save`` would
        symlink and print a warning for each file)."""
        import shutil

        dest = Path(self.run.dir) / (folder or "")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / Path(path).name)

    def where(self) -> str:
        if self.offline:
            return (f"wandb: offline run {self.run.id} in {self.run.settings.sync_dir}\n"
                    f"        send it: wandb sync {self.run.settings.sync_dir}")
        return f"wandb: {self.run.url}"

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
