"""The GPU weight sender a policy rank holds (``rlhf.workers.sync_cuda.sender_for``), picked by the
run's placement, and the worker methods the driver reaches it and the train states through. The
senders' constructors touch no GPU, so the choice is checked on CPU; sending needs a GPU
(tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rlhf.workers.sync_cuda import CudaIPCSender, NcclSender, nccl_lanes, sender_for
from rlhf.workers.critic import CriticWorker
from rlhf.workers.frozen import ReferenceWorker
from rlhf.workers.policy import PolicyWorker
from rlhf.workers.trained import TrainedWorker


def _spec(mode: str, engines=((0,), (1,))):
    from rlhf.placement import registry
    from rlhf.placement.layout import Layout

    roles = ("actor", "rollout")
    return NS(layout=Layout(mode=mode, total_devices=len(engines), roles={}, engines=engines,
                            pools=registry.get(mode).pools(roles)))


@pytest.mark.parametrize("mode,cls", [("hybrid", CudaIPCSender), ("disaggregated", NcclSender)])
def test_the_placement_picks_the_sender_and_only_rank_0_talks_to_the_engines(mode, cls):
    lead = sender_for(_spec(mode), ["e0", "e1"], rank=0)
    other = sender_for(_spec(mode), ["e0", "e1"], rank=1)
    assert type(lead) is cls and type(other) is cls
    assert lead.engines == ["e0", "e1"] and other.engines == []


def test_nccl_ranks_count_each_engines_tensor_parallel_workers():
    sender = sender_for(_spec("disaggregated", engines=((0, 1), (2, 3), (4, 5))), ["a", "b", "c"], rank=0)
    assert sender.engine_tp == [2, 2, 2] and sender.world_size == 7


def test_engines_that_share_a_gpu_are_in_different_nccl_lanes():
    """NCCL refuses two ranks of one group on one GPU: lane k holds the k-th engine of each device."""
    assert nccl_lanes([(4,), (4,), (5,), (5,)]) == [[0, 2], [1, 3]]
    assert nccl_lanes([(0, 1), (2, 3)]) == [[0, 1]]
    assert nccl_lanes([(6,), (6,), (6,), (6,), (7,)]) == [[0, 4], [1], [2], [3]]
    sender = sender_for(_spec("disaggregated", engines=((6,), (6,), (7,), (7,))), ["a", "b", "c", "d"], rank=0)
    assert sender.lanes == [[0, 2], [1, 3]]
    assert [sender.lane_world_size(lane) for lane in sender.lanes] == [3, 3]  # the trainer + one worker per engine


def test_trained_roles_answer_the_schedule_and_only_the_policy_sends():
    for cls in (PolicyWorker, CriticWorker):
        assert issubclass(cls, TrainedWorker)
    assert not issubclass(ReferenceWorker, TrainedWorker)
    assert hasattr(PolicyWorker, "gpu_sync_send") and not hasattr(CriticWorker, "gpu_sync_send")


def test_the_train_states_move_once_and_come_back_once(monkeypatch):
    """Offload twice without a reload moves the engine's states once (the schedule offloads after
    the first send and at the start); reload only after an offload."""
    import torch

    from rlhf.workers.sync_cuda import TrainStates

    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    calls = []
    engine = NS(offload_states=lambda include: calls.append(("offload", include)),
                reload_states=lambda: calls.append(("reload",)))
    states = TrainStates(engine, zero_stage=1)
    assert set(states.offload()) == {"time/offload_train"}  # the worker adds its resident figure
    states.offload()
    assert "time/reload_train" in states.reload()
    states.reload()
    assert calls == [("offload", None), ("reload",)]
    TrainStates(engine, zero_stage=0).offload()  # ZeRO-0: DeepSpeed cannot offload; only the figures
    assert calls == [("offload", None), ("reload",)]
