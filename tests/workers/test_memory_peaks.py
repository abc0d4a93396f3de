"""The training processes' memory figures: names, units, the counters' restart, and the cache
released after set-up. CUDA's allocator counters are stood in for (CPU machine)."""

from __future__ import annotations

import torch

from rlhf.workers.frozen import ReferenceWorker
from rlhf.workers.policy import PolicyWorker

GIB = 2**30


class FakeCuda:
    def __init__(self):
        self.reserved, self.allocated, self.resets, self.emptied = 12 * GIB, 9 * GIB, 0, 0

    def max_memory_reserved(self):
        return self.reserved

    def max_memory_allocated(self):
        return self.allocated

    def memory_reserved(self):
        return 4 * GIB if self.emptied else self.reserved

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.reserved, self.allocated = 4 * GIB, 3 * GIB

    def empty_cache(self):
        self.emptied += 1

    def synchronize(self):
        pass


def bare(cls, device: str, role: str):
    w = object.__new__(cls)  # no __init__: only the attributes these methods read
    w.device, w.role = device, role
    return w


def test_memory_peaks_names_units_and_restart(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    actor = bare(PolicyWorker, "cuda", "actor")
    assert actor.memory_peaks() == {"memory/train_peak_reserved_gib": 12.0, "memory/train_peak_allocated_gib": 9.0}
    assert fake.resets == 1
    # the next call sees only what happened since: the counters restarted
    assert actor.memory_peaks() == {"memory/train_peak_reserved_gib": 4.0, "memory/train_peak_allocated_gib": 3.0}
    ref = bare(ReferenceWorker, "cuda", "reference")
    fake.reserved, fake.allocated = 6 * GIB, 5 * GIB
    assert set(ref.memory_peaks()) == {"memory/reference_peak_reserved_gib", "memory/reference_peak_allocated_gib"}


def test_release_cuda_cache_reports_peaks_and_empties_the_cache(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    out = bare(PolicyWorker, "cuda", "actor").release_cuda_cache()
    assert out == {"memory/train_peak_reserved_gib": 12.0, "memory/train_peak_allocated_gib": 9.0,
                   "memory/train_resident_gib": 4.0}
    assert fake.emptied == 1 and fake.resets == 1


def test_no_figures_off_cuda():
    w = bare(PolicyWorker, "cpu", "actor")
    assert w.memory_peaks() == {} and w.release_cuda_cache() == {}


def test_set_up_ends_by_giving_its_cached_blocks_back(monkeypatch):
    """``init_distributed`` sets the worker up, then releases the cache (and restarts the peak
    counters) before anything else runs on the device."""
    import os

    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # no process group in this test
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the worker sets MASTER_ADDR etc.
    w = bare(PolicyWorker, "cpu", "actor")
    w.rank, w.world_size = 0, 1
    calls = []
    w.uses_deepspeed = lambda: False
    w.setup = lambda: calls.append("setup")
    w.release_cuda_cache = lambda: calls.append("release") or {}
    w.init_distributed("127.0.0.1", 12345)
    assert calls == ["setup", "release"]


def test_a_supervised_steps_peaks_are_its_own(monkeypatch):
    """train_step restarts the counters first: what ran before it (an evaluation, a checkpoint
    save) is not in the peaks it returns with its stats."""
    from types import SimpleNamespace

    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    w = bare(PolicyWorker, "cuda", "actor")
    w.engine = SimpleNamespace(gradient_accumulation_steps=lambda: 2, train=lambda: None, module=None,
                               backward=lambda loss, scale_wrt_gas: None)
    w.scheduler = SimpleNamespace(get_last_lr=lambda: [0.1])
    w._step = lambda: None

    def run_fn(objective, module, mb):  # the step's own passes reach 7 GiB (a peak only grows)
        fake.reserved, fake.allocated = max(fake.reserved, 7 * GIB), max(fake.allocated, 6 * GIB)
        return torch.tensor(1.0), {}

    w._run_fn = run_fn
    fake.reserved, fake.allocated = 100 * GIB, 90 * GIB  # an evaluation before the step
    out = w.train_step([{"input_ids": torch.zeros(4, 96), "real_index": torch.arange(200)},
                        {"input_ids": torch.zeros(2, 96), "real_index": torch.arange(150)}], objective=None)
    assert out["memory/train_peak_reserved_gib"] == 7.0 and out["memory/train_peak_allocated_gib"] == 6.0
    assert out["lr"] == 0.1
    assert out["perf/micro_batch_tokens_max"] == 200  # the largest's real tokens, not its 4 × 96 padded


def test_offloading_reports_each_roles_resident_state_under_its_name(monkeypatch):
    """The actor's and the critic's figures reach the loop together (rlhf.workers.schedule): each
    under its role's name, so the critic's is not dropped for the actor's."""
    from rlhf.workers.critic import CriticWorker

    fake = FakeCuda()
    fake.emptied = 1  # after the offload's empty_cache: 4 GiB left
    monkeypatch.setattr(torch, "cuda", fake)
    for cls, role, name in ((PolicyWorker, "actor", "train"), (CriticWorker, "critic", "critic")):
        w = bare(cls, "cuda", role)
        w.states = type("States", (), {"offload": lambda self: {"time/offload_train": 0.5}})()
        assert w.offload_train_states() == {"time/offload_train": 0.5, f"memory/{name}_resident_gib": 4.0}
