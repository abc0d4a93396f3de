"""Checkpoint directories: atomic writes, rotation, keep-best, and finding the newest for resume.

Layout of a run directory:

    <run_dir>/checkpoints/step_00000010/      one complete checkpoint
        driver.pt                             step, data position, RNG, KL controller, metrics
        <role>/                               each training role's DeepSpeed state (+ hf/ export)
        COMPLETE                              written last: a checkpoint without it is ignored;
                                              its manifest: every other file's size and SHA-256
    <run_dir>/final/hf/                       the final HF-format policy (from_pretrained-ready)

A checkpoint is written into ``step_XXXXXXXX.tmp`` and renamed when complete, so a run killed while
saving (SIGKILL, a second Ctrl-C) leaves the previous checkpoint intact and never a half-written one
that resume would pick; the next save (or rotation) removes the leftover ``.tmp``. Rotation deletes
older checkpoints only after the new one is in place.

The marker's manifest lets a resume check a checkpoint before anything starts (``verify``): a file
missing, cut short or with other bytes (a bad disk, a copy that stopped part way, a file edited by
hand) names the checkpoint and the file; the marker carries the SHA-256 of its own content, so a
marker that changed is found too. ``resume_point`` picks the newest intact checkpoint and sets the
corrupt ones aside (``step_XXXXXXXX.corrupt``, kept for a look, ignored by every lookup).
Hashing reads every byte the workers wrote, in threads (hashlib releases the GIL), once at
save and once at resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MARKER = "COMPLETE"
REPLACED = ".replaced"  # a checkpoint of the same step as one being committed, until that one is in place
CORRUPT = ".corrupt"  # a checkpoint that failed its manifest, set aside by resume_point
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def _hash_all(folder: Path, files: list[Path]) -> dict[str, str]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_sha256, files))
    return {p.relative_to(folder).as_posix(): d for p, d in zip(files, digests)}


def _seal(body: dict) -> dict:
    """``body`` with the SHA-256 of its own canonical JSON, so that a marker that changed is found."""
    text = json.dumps(body, sort_keys=True)
    return {**body, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def manifest(folder: Path) -> dict[str, list]:
    """Every file under ``folder`` but the marker: relative path → [size in bytes, SHA-256]."""
    files = _files(folder)
    digests = _hash_all(folder, files)
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, digests[p.relative_to(folder).as_posix()]]
            for p in files}


def read_marker(folder: Path) -> dict:
    """The marker of a checkpoint dir (raises ValueError when it cannot be read or changed)."""
    try:
        info = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{MARKER} cannot be read ({type(e).__name__})") from None
    if not isinstance(info, dict) or "step" not in info:
        raise ValueError(f"{MARKER} is not a checkpoint marker")
    if "sha256" in info:
        body = {k: v for k, v in info.items() if k != "sha256"}
        if _seal(body)["sha256"] != info["sha256"]:
            raise ValueError(f"{MARKER} changed after it was written (its checksum differs)")
    return info


def verify(folder: Path) -> Optional[str]:
    """Why the checkpoint in ``folder`` is not intact (the first file that differs from its
    manifest: missing, another size, other bytes; files no manifest names are ignored), or None.
    A marker without a manifest (a checkpoint of an older version) is taken as it is."""
    folder = Path(folder)
    try:
        info = read_marker(folder)
    except ValueError as e:
        return str(e)
    files = info.get("files")
    if files is None:
        return None
    for rel, (size, _) in sorted(files.items()):
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return f"{rel} is {p.stat().st_size} bytes, the manifest says {size}"
    digests = _hash_all(folder, [folder / rel for rel in sorted(files)])
    for rel, (_, digest) in sorted(files.items()):
        if digests[rel] != digest:
            return f"{rel} has other bytes than were written (SHA-256 differs)"
    return None


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

    def next_due(self, after: int, last_step: int) -> int:
        """The first step after step ``after`` that ``due`` saves at: a loop asks once per save
        instead of every step."""
        return min(last_step, (after // self.every + 1) * self.every) if self.every > 0 else last_step

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
        body = {"step": step, "metrics": metrics or {}, "files": manifest(tmp)}
        (tmp / MARKER).write_text(json.dumps(_seal(body)))  # last: the checkpoint is complete
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
            step = step_of(d)
            if step is None:  # a marker that cannot be read: resume_point names it
                step = int(name[5:])
                info = {}
            else:
                info = json.loads((d / MARKER).read_text())
            metric = info.get("metrics", {}).get(self.best_metric) if self.best_metric else None
            found.setdefault(step, CheckpointInfo(step=step, path=d, metric=metric))
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


def step_of(folder: Path) -> Optional[int]:
    """The step a checkpoint dir's marker records, None if it cannot be read."""
    try:
        return int(json.loads((Path(folder) / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


@dataclass
class ResumePoint:
    """What a resume starts from: ``chosen`` (None: no checkpoint, a fresh start), and the
    checkpoints found corrupt on the way, each ``(path it was moved to, why)``."""

    chosen: Optional[CheckpointInfo]
    corrupt: list[tuple[Path, str]] = field(default_factory=list)


def resume_point(source: str | os.PathLike, set_aside: bool = True) -> ResumePoint:
    """The checkpoint a run resumes from, verified: ``source`` is a run dir (its newest intact
    checkpoint; a corrupt newer one is named, set aside as ``<name>.corrupt`` unless not
    ``set_aside``, and the next older one checked) or one checkpoint dir (it must be intact).
    Raises ValueError, one line, when checkpoints exist and none is intact, or the one named is not."""
    p = Path(source)
    if p.name.startswith("step_") and (p / MARKER).exists():
        why = verify(p)
        if why is not None:
            raise ValueError(f"checkpoint {p} is corrupt: {why}. Resume from an intact one "
                             f"(resume=<run dir> takes the newest intact one) or start afresh.")
        return ResumePoint(CheckpointInfo(step=int(read_marker(p)["step"]), path=p))
    out = ResumePoint(None)
    for c in reversed(CheckpointManager(p, every=0, keep_last=1).complete()):
        why = verify(c.path)
        if why is None:
            out.chosen = c
            return out
        where = c.path
        if set_aside:
            where = c.path.with_name(c.path.name + CORRUPT)
            if where.exists():
                shutil.rmtree(where, ignore_errors=True)
            os.replace(c.path, where)
        out.corrupt.append((where, why))
    if out.corrupt:
        names = ", ".join(f"{w.name} ({why})" for w, why in out.corrupt)
        raise ValueError(f"no intact checkpoint in {p / 'checkpoints'}: {names}. Start afresh in another "
                         "output_dir, or restore the checkpoints from a copy.")
    return out
