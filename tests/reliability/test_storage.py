"""Refused writes without a run (rlhf.storage, rlhf.track.MetricsFile): a full disk (the kernel's
own ENOSPC from /dev/full, or a writer patched to fail half-way), torch's errno-less write error,
and a run dir deleted under the writer, each one line naming the path; metrics.jsonl keeps only
whole lines."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from tests.helpers import assert_clear

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


def test_metrics_write_that_fills_the_disk_half_way_leaves_whole_lines(tmp_path, monkeypatch):
    from rlhf.storage import StorageError
    from rlhf.track import MetricsFile, metrics_file

    f = MetricsFile(tmp_path)
    f.write({"step": 0, "reward/mean": 0.5})
    real = metrics_file._write

    def half_then_full(fd, data):
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics_file, "_write", half_then_full)
    with pytest.raises(StorageError) as e:
        f.write({"step": 1, "reward/mean": 0.25})
    f.close()
    assert_clear(str(e.value), "disk full while writing the metrics", str(tmp_path / "metrics.jsonl"),
                 "No space left on device", "it needs", "bytes", "free there", "No checkpoint was written yet",
                 f"resume={tmp_path}")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "reward/mean": 0.5}]  # the half line was cut off again


@needs_dev_full
def test_metrics_on_a_full_device(tmp_path):
    from rlhf.storage import StorageError
    from rlhf.track import MetricsFile

    os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC from the kernel
    f = MetricsFile(tmp_path)
    with pytest.raises(StorageError) as e:
        f.write({"step": 3, "x": 1.0})
    f.close()
    assert_clear(str(e.value), "disk full while writing the metrics", "No space left on device")


def test_a_deleted_run_dir_is_noticed_at_the_next_write(tmp_path):
    from rlhf.storage import StorageError
    from rlhf.track import MetricsFile

    run = tmp_path / "run"
    run.mkdir()
    f = MetricsFile(run)
    f.write({"step": 0})
    shutil.rmtree(run)  # a cleanup script
    with pytest.raises(StorageError) as e:
        f.write({"step": 1})
    f.close()
    assert_clear(str(e.value), f"the output dir {run} disappeared during the run", "start again")
    assert not run.exists()  # not silently re-made


@needs_dev_full
def test_torch_write_error_without_errno_is_named(tmp_path):
    import torch

    from rlhf import storage

    os.symlink("/dev/full", tmp_path / "driver.pt")
    with pytest.raises(storage.StorageError) as e:
        with storage.writing(tmp_path / "driver.pt", "the checkpoint of step 2", tmp_path,
                             cleanup=lambda: (tmp_path / "driver.pt").unlink()):
            torch.save({"w": torch.zeros(4096)}, tmp_path / "driver.pt")
    # the filesystem itself has room (only /dev/full is full): said as a likely cause, not a fact
    assert_clear(str(e.value), "write failed (most likely a full disk) while writing the checkpoint of step 2",
                 str(tmp_path / "driver.pt"), "free there")
    assert not (tmp_path / "driver.pt").exists()  # cleaned up


def test_other_errors_pass_through(tmp_path):
    from rlhf import storage

    with pytest.raises(ValueError):
        with storage.writing(tmp_path / "x", "x", tmp_path):
            raise ValueError("not a storage problem")
    with pytest.raises(FileNotFoundError):  # a missing file while the run dir is there: not "gone"
        with storage.writing(tmp_path / "x", "x", tmp_path):
            open(tmp_path / "no" / "such")


def test_a_read_only_output_dir_is_named(tmp_path, monkeypatch):
    from rlhf.storage import StorageError
    from rlhf.track import MetricsFile, metrics_file

    f = MetricsFile(tmp_path)

    def read_only(fd, data):  # a filesystem remounted read-only after an I/O error, an NFS export gone ro
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(metrics_file, "_write", read_only)
    with pytest.raises(StorageError) as e:
        f.write({"step": 0})
    f.close()
    assert_clear(str(e.value), str(tmp_path / "metrics.jsonl"), "Read-only file system",
                 "became read-only", f"Make {tmp_path} writable again", f"resume={tmp_path}")


def test_a_checkpoint_into_a_deleted_run_dir_does_not_remake_it(tmp_path):
    from rlhf import storage
    from rlhf.ckpt import CheckpointManager

    run = tmp_path / "run"
    m = CheckpointManager(run, every=1, keep_last=2)
    run.mkdir()
    shutil.rmtree(run)
    with pytest.raises(storage.StorageError) as e:
        with storage.writing(m.root / "step_00000002.tmp", "the checkpoint of step 2", run):
            m.begin(2)
    assert_clear(str(e.value), f"the output dir {run} disappeared during the run", "the checkpoint of step 2")
    assert not run.exists()


def test_a_full_disk_no_write_block_caught_is_still_one_line(tmp_path):
    from rlhf import storage

    run = tmp_path / "run"
    run.mkdir()
    with_path = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "spec.yaml"))
    assert_clear(storage.uncaught(with_path, run), "disk full while writing the run's files to",
                 str(run / "spec.yaml"), f"resume={run}")
    assert_clear(storage.uncaught(OSError(errno.ENOSPC, "No space left on device"), run),
                 "disk full (No space left on device)", f"the run dir {run} has", "/tmp/ray")
    # a permission problem outside the run dir (a model dir) is not explained as the run dir's
    assert storage.uncaught(PermissionError(errno.EACCES, "Permission denied", "/models/x"), run) is None
    assert storage.uncaught(ValueError("no"), run) is None


def test_publish_shows_the_whole_dir_or_none_and_replaces_an_older_one(tmp_path):
    """``storage.publish`` (the HF exports): the final dir appears only complete; a failure inside
    leaves the previous dir as it was and no temporary dir behind; a new one replaces the old."""
    from rlhf.storage import publish

    final = tmp_path / "final" / "hf"
    with publish(final) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not final.exists()  # nothing under the final name while writing
    assert (final / "config.json").read_text() == "{}"

    with pytest.raises(RuntimeError):
        with publish(final) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    assert [p.name for p in final.parent.iterdir()] == ["hf"]

    with publish(final) as tmp:
        (tmp / "model.safetensors").write_text("whole")
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"]
    assert [p.name for p in final.parent.iterdir()] == ["hf"]


def test_publish_gives_the_dir_the_permissions_of_a_plain_mkdir(tmp_path):
    from rlhf.storage import publish

    old = os.umask(0o022)
    try:
        with publish(tmp_path / "hf") as tmp:
            pass
        plain = tmp_path / "plain"
        plain.mkdir()
    finally:
        os.umask(old)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o755


def test_publish_removes_what_a_killed_writer_left_and_keeps_a_setgid_group(tmp_path):
    """A writer killed part way leaves its hidden dir (and, between the two renames, the old dir set
    aside): the next publish of the same name removes them, and nothing else. In a group-shared
    (setgid) parent the published dir keeps the bit, as a plain mkdir there would."""
    import stat

    from rlhf.storage import publish

    parent = tmp_path / "final"
    parent.mkdir()
    os.chmod(parent, 0o2775)
    for left in (".hf.abc123", ".hf.old.xyz789"):
        (parent / left).mkdir()
        (parent / left / "model.safetensors").write_bytes(b"\0" * 1000)
    (parent / ".adapter.keep1").mkdir()  # another name's: not ours to remove
    with publish(parent / "hf") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in parent.iterdir()) == [".adapter.keep1", "hf"]
    plain = parent / "plain"
    plain.mkdir()
    assert (parent / "hf").stat().st_mode & stat.S_ISGID == plain.stat().st_mode & stat.S_ISGID != 0
