import os

import pytest

from rlhf.ckpt import CheckpointManager, find_latest


def _save(m, step, metric=None):
    tmp = m.begin(step)
    (tmp / "driver.pt").write_bytes(b"x" * step)
    return m.commit(tmp, step, {"eval/reward": metric} if metric is not None else None)


def test_rotation_keeps_last_n(tmp_path):
    m = CheckpointManager(tmp_path, every=1, keep_last=2)
    for s in range(1, 6):
        _save(m, s)
    assert [c.step for c in m.complete()] == [4, 5]
    assert find_latest(tmp_path).step == 5


def test_keep_best_survives_rotation(tmp_path):
    m = CheckpointManager(tmp_path, every=1, keep_last=1, best_metric="eval/reward")
    for s, r in [(1, 0.1), (2, 0.9), (3, 0.3), (4, 0.2)]:
        _save(m, s, r)
    assert [c.step for c in m.complete()] == [2, 4]


def test_incomplete_checkpoint_is_ignored_and_previous_kept(tmp_path):
    m = CheckpointManager(tmp_path, every=1, keep_last=3)
    _save(m, 1)
    tmp = m.begin(2)  # a save killed half-way: never committed
    (tmp / "driver.pt").write_bytes(b"partial")
    assert find_latest(tmp_path).step == 1
    # a committed dir whose marker is missing (killed between rename and marker cannot happen,
    # but a hand-copied dir without it) is ignored too
    os.makedirs(m.root / "step_00000009")
    assert find_latest(tmp_path).step == 1


def test_due_every_and_at_end():
    m = CheckpointManager("/nonexistent", every=3, keep_last=1)
    assert [s for s in range(1, 11) if m.due(s, 10)] == [3, 6, 9, 10]
    m0 = CheckpointManager("/nonexistent", every=0, keep_last=1)
    assert [s for s in range(1, 11) if m0.due(s, 10)] == [10]


@pytest.mark.parametrize("every,last", [(3, 10), (0, 10), (1, 4), (5, 5), (12, 10), (4, 12)])
def test_next_due_is_the_next_step_due_saves_at(every, last):
    """The RL loop asks ``next_due`` once per save instead of ``due`` every step: the same steps,
    from the start and from any resumed step."""
    m = CheckpointManager("/nonexistent", every=every, keep_last=1)
    for start in range(last):
        saves, nxt = [], m.next_due(start, last)
        for s in range(start + 1, last + 1):
            if s == nxt:
                saves.append(s)
                nxt = m.next_due(s, last)
        assert saves == [s for s in range(start + 1, last + 1) if m.due(s, last)], (every, last, start)


def test_saving_a_step_again_leaves_no_moment_without_it(tmp_path):
    m = CheckpointManager(tmp_path, every=1, keep_last=1)
    _save(m, 5)
    # a save of step 5 again, stopped right after the old one was set aside (before the new one moved in)
    os.replace(m.root / "step_00000005", m.root / "step_00000005.replaced")
    assert find_latest(tmp_path).step == 5 and find_latest(tmp_path).path.name == "step_00000005.replaced"
    _save(m, 5)  # done properly: the new one in place, the one set aside removed
    assert sorted(p.name for p in m.root.iterdir()) == ["step_00000005"]
    assert m.last_saved == 5 and (m.root / "step_00000005" / "driver.pt").read_bytes() == b"x" * 5


def test_save_interrupted_midway_keeps_the_previous_one(tmp_path):
    m = CheckpointManager(tmp_path, every=1, keep_last=1)
    _save(m, 1)
    tmp = m.begin(2)
    try:
        (tmp / "driver.pt").write_bytes(b"half")
        raise KeyboardInterrupt  # a second Ctrl-C while the workers write their state
    except KeyboardInterrupt:
        pass
    assert find_latest(tmp_path).step == 1 and m.last_saved == 1
    _save(m, 3)  # the next save cleans up the abandoned .tmp
    assert sorted(p.name for p in m.root.iterdir()) == ["step_00000003"]


# ----------------------------------------------------------------------------- manifest


def _ckpt(m, step):
    """A checkpoint with nested files of several sizes, as a trained role's would be."""
    tmp = m.begin(step)
    (tmp / "driver.pt").write_bytes(bytes(range(256)) * step)
    (tmp / "actor" / "ds").mkdir(parents=True)
    (tmp / "actor" / "ds" / "shard.pt").write_bytes(os.urandom(5000))
    (tmp / "actor" / "rng_rank0.pt").write_bytes(b"r" * 7)
    return m.commit(tmp, step)


def _every_file(path):
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_every_file_cut_short_or_changed_is_named(tmp_path):
    from rlhf.ckpt import verify

    m = CheckpointManager(tmp_path, every=1, keep_last=3)
    path = _ckpt(m, 1)
    assert verify(path) is None
    files = _every_file(path)
    assert len(files) == 4  # the marker too
    for f in files:
        rel = f.relative_to(path).as_posix()
        data = f.read_bytes()
        mid = len(data) // 2
        for broken in (data[:mid], data[:-1], data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:],
                       data[:-1] + bytes([data[-1] ^ 0x80])):
            f.write_bytes(broken)
            why = verify(path)
            assert why is not None and rel in why, (rel, why)
            f.write_bytes(data)
        assert verify(path) is None
    (path / "actor" / "ds" / "shard.pt").unlink()
    assert verify(path) == "actor/ds/shard.pt is missing"


def test_resume_point_sets_a_corrupt_newest_aside_and_takes_the_next(tmp_path):
    from rlhf.ckpt import resume_point

    m = CheckpointManager(tmp_path, every=1, keep_last=3)
    for s in (1, 2, 3):
        _ckpt(m, s)
    shard = m.root / "step_00000003" / "actor" / "ds" / "shard.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    point = resume_point(tmp_path)
    assert point.chosen.step == 2 and point.chosen.path == m.root / "step_00000002"
    (where, why), = point.corrupt
    assert where == m.root / "step_00000003.corrupt" and "actor/ds/shard.pt is 100 bytes" in why
    assert find_latest(tmp_path).step == 2  # nothing else picks the corrupt one up again
    # the next save of step 3 goes where it was; rotation leaves the set-aside copy for a look
    _ckpt(m, 3)
    assert [c.step for c in m.complete()] == [1, 2, 3] and where.is_dir()
    assert resume_point(tmp_path).chosen.step == 3


def test_resume_point_refuses_in_one_line(tmp_path):
    import pytest

    from rlhf.ckpt import resume_point

    m = CheckpointManager(tmp_path, every=1, keep_last=3)
    assert resume_point(tmp_path).chosen is None  # no checkpoint: a fresh start
    for s in (1, 2):
        _ckpt(m, s)
    named = m.root / "step_00000002"
    (named / "driver.pt").write_bytes(b"")
    with pytest.raises(ValueError) as e:  # a checkpoint named by resume= is taken or refused, never replaced
        resume_point(named)
    assert "\n" not in str(e.value) and f"checkpoint {named} is corrupt: driver.pt is 0 bytes" in str(e.value)
    (m.root / "step_00000001" / "COMPLETE").write_text("{")
    with pytest.raises(ValueError) as e:
        resume_point(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"no intact checkpoint in {m.root}: ")
    assert "step_00000002.corrupt (driver.pt is 0 bytes" in msg and "step_00000001.corrupt (COMPLETE cannot be read" in msg


def test_a_marker_without_manifest_is_taken_as_it_is(tmp_path):
    import json

    from rlhf.ckpt import resume_point

    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "driver.pt").write_bytes(b"x")
    (step / "COMPLETE").write_text(json.dumps({"step": 4, "metrics": {}}))  # written before manifests
    assert resume_point(tmp_path).chosen.step == 4
