"""train.expandable_segments: a training process grows its allocator segments, while the buffers
vLLM opens over CUDA IPC come from plain segments (an IPC handle cannot name a growable range)."""

from types import SimpleNamespace

import pytest
import torch

from rlhf.workers import allocator, sync_cuda
from rlhf.workers.model import ModelWorker

getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
pytestmark = pytest.mark.skipif(getter is None, reason="this torch has no allocator-settings getter")


def _setting() -> bool:
    return "expandable_segments:True" in getter()


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    # a worker process hides MLflow and scikit-learn from itself at start; this one is pytest's
    monkeypatch.setattr("rlhf.workers.base.skip_unused_imports", lambda: None)
    yield
    allocator.set_expandable_segments(False)


def _spec(device: str, on: bool):
    return SimpleNamespace(device=device, train=SimpleNamespace(seed=0, expandable_segments=on, offload_optimizer=False,
                                                                zero_stage=2),
                           tracking=SimpleNamespace(console="verbose"))  # verbose: no worker log files


def test_a_gpu_training_process_turns_expandable_segments_on_first():
    ModelWorker(_spec("cuda", True), "actor", 0, 1)
    assert _setting()


@pytest.mark.parametrize("device,on", [("cuda", False), ("cpu", True)])
def test_otherwise_the_allocator_is_left_alone(device, on):
    ModelWorker(_spec(device, on), "actor", 0, 1)
    assert not _setting()


def test_ipc_buffers_come_from_plain_segments_and_the_setting_returns(monkeypatch):
    allocator.set_expandable_segments(True)
    seen = []
    real_empty = torch.empty

    def empty(*a, **k):
        seen.append(_setting())
        return real_empty(*a, **k)

    monkeypatch.setattr(sync_cuda.torch, "empty", empty)
    bufs = sync_cuda.ipc_buffers(64, torch.device("cpu"), 2)
    assert [b.numel() for b in bufs] == [64, 64] and seen == [False, False]
    assert _setting()


def test_plain_segments_leaves_a_process_without_them_as_it_was():
    with allocator.plain_segments():
        assert not _setting()
    assert not _setting()
