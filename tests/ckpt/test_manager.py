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
