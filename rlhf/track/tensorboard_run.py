"""TensorBoard: event files in ``<run dir>/tensorboard``, written with tensorboardX (no TensorFlow).

Scalars under the same names and steps as MLflow (``reward/mean`` at step 3 is the same point in
both); the config as a text summary ``config`` (one ``key: value`` line per flattened param, the
MLflow params). A sweep's jobs are ``<sweep dir>/<n>/tensorboard``, so ``tensorboard --logdir
<sweep dir>`` shows them side by side, one run per job folder. A resumed run appends a new event
file in the same folder; TensorBoard joins them by step.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlhf.spec.runspec import RunSpec


def logdir(run_dir: str) -> Path:
    return Path(run_dir) / "tensorboard"


class TensorBoardRun:
    """Events written in the calling thread, each step flushed: tensorboardX's ``SummaryWriter``
    hands events to a writer thread through a bounded queue, so a disk that fills would kill that
    thread and the next steps would block on the full queue; here the write raises instead, and
    the Tracker drops TensorBoard with one line."""

    name = "tensorboard"

    def __init__(self, spec: RunSpec, run_dir: str):
        from tensorboardX.event_file_writer import EventsWriter

        from rlhf.track.params import string_params

        self.dir = logdir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(run_dir)
        self.writer = EventsWriter(str(self.dir / "events"))
        self.closed = False
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(string_params(spec).items()))  # indented: markdown code
        self._text("config", text)

    def _write(self, step: int, summary) -> None:  # noqa: ANN001 - a tensorboardX Summary proto
        from tensorboardX.proto import event_pb2

        self.writer.write_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def _text(self, tag: str, text: str) -> None:
        from tensorboardX.summary import text as text_summary

        self._write(0, text_summary(tag, text))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        # one event a step, the tags exactly MLflow's names (tensorboardX's scalar() would rewrite some)
        self._write(step, Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]))

    def log_model_path(self, path: str) -> None:
        self._text("final_model", str(Path(path).resolve()))

    def where(self) -> str:
        parent = self.run_dir.resolve().parent
        return (f"tensorboard: {self.dir}\n"
                f"        view it: tensorboard --logdir {self.dir}  (or --logdir {parent} for every run beside it)")

    def finish(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._text("status", status)
        finally:
            self.writer.close()
