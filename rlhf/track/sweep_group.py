"""Sweep hooks of the trackers other than MLflow: each job's W&B run joins its sweep's group.

(MLflow's parent/child runs are ``rlhf.sweep.MlflowSweepHooks``; TensorBoard needs nothing: a
job's event files are in ``<sweep dir>/<n>/tensorboard``.) The group is a context variable, like
MLflow's parent, so the parallel launcher's jobs in threads each keep their own.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from rlhf.spec.runspec import RunSpec


class TrackerSweepHooks:
    """``rlhf.sweep.SweepHooks``' four calls (duck-typed: rlhf.sweep imports this module's users)."""

    def __init__(self) -> None:
        self.sweep_dir: Optional[str] = None

    def sweep_start(self, sweep_dir: Optional[str], jobs: Sequence[Any]) -> None:
        self.sweep_dir = sweep_dir

    def job_start(self, job: Any, spec: RunSpec) -> None:
        from rlhf.track.params import SWEEP_GROUP

        SWEEP_GROUP.set((self.sweep_dir or str(spec.output_dir), str(job.index)))

    def job_end(self, job: Any, result: Any) -> None:
        from rlhf.track.params import SWEEP_GROUP

        SWEEP_GROUP.set(None)

    def sweep_end(self, sweep_dir: Optional[str], results: Sequence[Any]) -> None:
        pass
