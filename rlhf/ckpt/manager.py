"""Checkpoint directories: atomic writes, rotation, keep-best, and finding the newest for resume.

Layout of a run directory:

    <run_dir>/checkpoints/step_00000010/      one complete checkpoint
        driver.pt                             step, data position, RNG, KL controller, metrics
        <role>/                               each training role's DeepSpeed state (+ hf/ export)
        COMPLETE                              written last: a checkpoint without it is ignored
    <run_dir>/final/hf/                       the final HF-format policy (from_pretrained-ready)

A checkpoint is written into ``step_XXXXXXXX.tmp`` and renamed when complete, so a run killed while
saving (SIGKILL, a second Ctrl-C) leaves the previous checkpoint intact and never a half-written one
that resume would pick; the next save (or rotation) removes the leftover ``.tmp``. Rotation deletes
older checkpoints only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MARKER = "COMPLETE"
REPLACED = ".replaced"  # a checkpoint of the same step as one being committed, until that one is in place


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    metric: Optional[float] = None


class CheckpointManager:
    """Owns ``<run_dir>/checkpoints``: where to write, when, and which to keep.

    keep_last: the newest N complete checkpoints survive rotation.
    best_metric: if set, the checkpoint with the highest value of that metric also survives.
    """

    def __init__(self, run_dir: str | os.PathLike, every: int, keep_last: int, best_metric: Optional[str] = None):
        self.root = Path(run_dir) / "checkpoints"
        self.every = every
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.last_saved: Optional[int] = None  # the step of the last checkpoint committed by this manager
        self.unranked_warned = False  # the RL loop said once that best_metric is missing

    def due(self, step: int, last_step: int) -> bool:
        """Save after ``step`` (1-based count of finished steps)? Always at the end."""
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def begin(self, step: int) -> Path:
        """A fresh temporary directory to write checkpoint ``step`` into."""
        tmp = self.root / (step_dir_name(step) + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        self.root.mkdir(exist_ok=True)  # not parents: a run dir deleted mid-run is an error, not re-made
        tmp.mkdir()
        return tmp

    def abort(self, tmp: Path) -> None:
        """Drop a save that failed (its space back at once; the previous checkpoints are untouched)."""
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: Path, step: int, metrics: Optional[dict] = None) -> Path:
        """Mark ``tmp`` complete, move it into place, then rotate old checkpoints."""
        (tmp / MARKER).write_text(json.dumps({"step": step, "metrics": metrics or {}}))
        final = self.root / step_dir_name(step)
        if final.exists():  # the same step again (a rerun from an older checkpoint): set the old one
            aside = self.root / (step_dir_name(step) + REPLACED)  # aside, still complete until the
            if aside.exists():  # new one is in place, so no moment is without this step
                shutil.rmtree(aside)
            os.replace(final, aside)
        os.replace(tmp, final)
        self.last_saved = step
        self.rotate()
        return final

    def complete(self) -> list[CheckpointInfo]:
        if not self.root.is_dir():
            return []
        found: dict[int, CheckpointInfo] = {}
        for d in sorted(self.root.iterdir(), key=lambda d: d.name.endswith(REPLACED)):  # plain dirs first
            name = d.name[: -len(REPLACED)] if d.name.endswith(REPLACED) else d.name
            if not (d.is_dir() and name.startswith("step_") and name[5:].isdigit() and (d / MARKER).exists()):
                continue  # .tmp (being written or abandoned), no marker (incomplete), not ours
            info = json.loads((d / MARKER).read_text())
            metric = info.get("metrics", {}).get(self.best_metric) if self.best_metric else None
            found.setdefault(int(info["step"]), CheckpointInfo(step=int(info["step"]), path=d, metric=metric))
        return [found[k] for k in sorted(found)]

    def latest(self) -> Optional[CheckpointInfo]:
        done = self.complete()
        return done[-1] if done else None

    def rotate(self) -> None:
        """Delete all but the newest ``keep_last`` and the best, and leftovers of earlier saves."""
        done = self.complete()
        keep = {c.path for c in done[-self.keep_last:]}
        scored = [c for c in done if c.metric is not None]
        if scored:
            keep.add(max(scored, key=lambda c: c.metric).path)  # the first of equal best values
        for c in done:
            if c.path not in keep:
                shutil.rmtree(c.path, ignore_errors=True)
        for stale in [*self.root.glob("*.tmp"), *self.root.glob("*" + REPLACED)]:
            if stale not in keep:
                shutil.rmtree(stale, ignore_errors=True)


def find_latest(run_dir: str | os.PathLike) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint of a run directory, or None."""
    return CheckpointManager(run_dir, every=0, keep_last=1).latest()
