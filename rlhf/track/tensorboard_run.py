"""TensorBoard: event files in ``<run dir>/tensorboard``, written with tensorboardX (no TensorFlow).

Scalars under the same names and steps as MLflow (``reward/mean`` at step 3 is the same point in
both); the config as a text summary ``config`` (one ``key: value`` line per flattened param, the
MLflow params). A sweep's jobs are ``<sweep dir>/<n>/tensorboard``, so ``tensorboard --logdir
<sweep dir>`` shows them side by side, one run per job folder. A resumed run appends a new event
file in the same folder; TensorBoard joins them by step.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.spec.runspec import RunSpec


def logdir(run_dir: str) -> Path:
    return Path(run_dir) / "tensorboard"


class TensorBoardRun:
    name = "tensorboard"

    def __init__(self, spec: RunSpec, run_dir: str):
        from tensorboardX import SummaryWriter

        from rlhf.track.params import string_params

        self.dir = logdir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(run_dir)
        # flush_secs: a crashed run still leaves the curves of its last half minute on disk
        self.writer = SummaryWriter(logdir=str(self.dir), flush_secs=30)
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(string_params(spec).items()))  # indented: markdown code
        self.writer.add_text("config", text, 0)
        self.writer.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_model_path(self, path: str) -> None:
        self.writer.add_text("final_model", str(Path(path).resolve()), 0)

    def where(self) -> str:
        parent = self.run_dir.resolve().parent
        return (f"tensorboard: {self.dir}\n"
                f"        view it: tensorboard --logdir {self.dir}  (or --logdir {parent} for every run beside it)")

    def finish(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()
