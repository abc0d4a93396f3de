"""A full disk during a real RL run (in-process, on the session's Ray), at each of the three writes:

* metrics: the driver's metrics.jsonl writer is patched to fill the disk half-way through step 2's line;
* checkpoint: the driver's ``torch.save`` is patched to fill the disk half-way through step 2's
  ``driver.pt``, after the actor worker has written its DeepSpeed state into the same ``.tmp``;
* export: in the actor worker, the export's temporary dir (``rlhf.storage.publish``) gets its
  ``config.json`` linked to /dev/full, so the worker's own ``save_pretrained`` gets the kernel's
  ENOSPC inside Ray.

Each run exits 1 with one ``error:`` line naming the path (and the bytes needed where known), the
previous checkpoint complete and loadable, no partial checkpoint or export left, no actor or
placement group left. After the export case the disk is "freed" and ``resume=`` writes the export
from the intact checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.helpers import assert_clear, leftovers, run_rl, snapshot

TOY = ["algo=grpo", "train.prompts_per_step=4", "algo.group_size=2", "train.micro_batch_size=8",
       "rollout.max_response_tokens=1", "tracking.backend=none", "checkpoint.every=1", "checkpoint.save_hf=false"]


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _assert_loadable(out: Path, step: int) -> None:
    """The newest checkpoint is ``step``, complete, every file of it loads, nothing half-written."""
    import torch

    from rlhf.ckpt import find_latest

    latest = find_latest(out)
    assert latest is not None and latest.step == step, latest
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert torch.load(latest.path / "driver.pt", weights_only=False)["step"] == step
    pts = list(latest.path.rglob("*.pt"))
    assert any("ds" in p.parts for p in pts)  # the actor's DeepSpeed state
    for p in pts:
        torch.load(p, weights_only=False, map_location="cpu")


def _run_that_fills_the_disk(tmp_path, capsys):
    """A 3-step toy run that must stop with exit 1: (its dir, its metrics, the error line, the
    Ray snapshot taken before it)."""
    out = tmp_path / "run"
    before = snapshot()
    code, rows = run_rl(TOY + ["train.steps=3"], out)
    line = _error_line(capsys.readouterr().err)
    assert code == 1
    return out, rows, line, before


def test_disk_full_writing_metrics(rl_env, tmp_path, capsys, monkeypatch):
    from rlhf.track import metrics_file

    real = metrics_file._write

    def fills_at_step_2(fd, data):
        if b'"step": 2,' in bytes(data):
            real(fd, data[: len(data) // 2])
            raise _enospc()
        return real(fd, data)

    monkeypatch.setattr(metrics_file, "_write", fills_at_step_2)
    out, rows, line, before = _run_that_fills_the_disk(tmp_path, capsys)
    assert_clear(line, f"disk full while writing the metrics to {out / 'metrics.jsonl'}", "No space left on device",
                 "it needs", "The checkpoint of step 1 is intact", f"resume={out}")
    assert [r["step"] for r in rows] == [1]  # whole lines only
    _assert_loadable(out, 1)
    assert leftovers(*before) == ([], [])


def test_disk_full_writing_a_checkpoint(rl_env, tmp_path, capsys, monkeypatch):
    import torch

    real = torch.save

    def fills_at_checkpoint_2(obj, f, *a, **k):
        if str(f).endswith("step_00000002.tmp/driver.pt"):
            Path(f).write_bytes(b"\0" * 1000)
            raise _enospc()
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", fills_at_checkpoint_2)
    out, rows, line, before = _run_that_fills_the_disk(tmp_path, capsys)
    assert_clear(line, "disk full while writing the checkpoint of step 2 to "
                 f"{out / 'checkpoints' / 'step_00000002.tmp'}", "No space left on device",
                 "(the size of the previous checkpoint)", "free there",
                 f"The checkpoint of step 1 is intact ({out / 'checkpoints' / 'step_00000001'})", f"resume={out}")
    assert [r["step"] for r in rows] == [1, 2]
    _assert_loadable(out, 1)  # and the partial step 2 (the worker's state, half a driver.pt) is gone
    assert not (out / "final").exists()
    assert leftovers(*before) == ([], [])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full for the kernel's ENOSPC")
def test_disk_full_writing_the_export_then_resume_writes_it(rl_env, tmp_path, capsys, monkeypatch):
    from rlhf.launch.group import ActorGroup, RoleHandle, method_name

    out = tmp_path / "run"
    real = ActorGroup.call_async

    def into_a_full_disk(worker, path):
        """In the actor worker: its export's temporary dir gets config.json linked to /dev/full,
        so its own save_pretrained meets the kernel's ENOSPC, inside Ray."""
        import rlhf.storage as storage

        sibling = storage._sibling

        def full_sibling(final):
            tmp = sibling(final)
            os.symlink("/dev/full", tmp / "config.json")
            return tmp

        storage._sibling = full_sibling
        try:
            return worker.save_hf(path)
        finally:
            storage._sibling = sibling

    def on_host(host, role, path):  # a colocated rank: the role's worker object on its host actor
        return into_a_full_disk(host.workers[role], path)

    def export_on_a_full_disk(self, method, *args, **kwargs):
        if method_name(method) == "save_hf" and str(args[0]).endswith("final/hf"):
            return [w.host.__ray_call__.remote(on_host, self.role, *args) if isinstance(w, RoleHandle)
                    else w.__ray_call__.remote(into_a_full_disk, *args) for w in self.workers]
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(ActorGroup, "call_async", export_on_a_full_disk)
    before = snapshot()
    code, rows = run_rl(TOY + ["train.steps=1"], out)
    line = _error_line(capsys.readouterr().err)
    assert code == 1
    assert_clear(line, f"disk full while writing the final HF export to {out / 'final' / 'hf'}",
                 "No space left on device", "free there", "The checkpoint of step 1 is intact", f"resume={out}")
    assert [r["step"] for r in rows] == [1]
    _assert_loadable(out, 1)
    assert not (out / "final" / "hf").exists()  # no half export for from_pretrained to trip on
    assert not list((out / "final").glob(".hf.*"))  # nor its temporary dir
    assert leftovers(*before) == ([], [])

    # space again: resume= of the finished run writes the export from its checkpoint
    monkeypatch.setattr(ActorGroup, "call_async", real)
    from transformers import AutoModelForCausalLM

    from rlhf.cli import main

    assert main([f"resume={out}", "tracking.console=plain"]) == 0
    assert f"saved {out / 'final' / 'hf'} (HF format)" in capsys.readouterr().out
    AutoModelForCausalLM.from_pretrained(str(out / "final" / "hf"))
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert leftovers(*before) == ([], [])
