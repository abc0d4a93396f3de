import os

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
