"""Ctrl-C / SIGTERM during an sft/rm/dpo run (``rlhf.loops.supervised.train_epochs``): the step
under way finishes, a checkpoint of it is written, and the run stops with KeyboardInterrupt
(``Terminated`` for SIGTERM), which ``rlhf.run`` turns into exit 130 (143). No Ray: the workers
and the checkpoint writer are stand-ins that record what the loop asks of them."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest


class _Actor:
    def __init__(self, signum, at_call):
        self.calls, self.signum, self.at_call = 0, signum, at_call

    def scatter(self, method, shards, objective):
        self.calls += 1
        if self.calls == self.at_call:  # the signal arrives in the middle of this step
            os.kill(os.getpid(), self.signum)
        return [{"loss": 1.0, "n": 1.0, "perf/micro_batch_tokens_max": 8.0}]


class _Manager:
    def __init__(self):
        self.last_saved = None

    def due(self, done, n_steps):
        return done == n_steps  # checkpoint.every=0: only at the end


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_the_step_checkpoints_it_and_stops(tmp_path, monkeypatch, signum):
    from rlhf.cli import build_spec, compose
    from rlhf.ckpt import training as ckpt_io
    from rlhf.loops import supervised
    from rlhf.run import Terminated

    overrides = ["algo=sft", "tracking=none", f"output_dir={tmp_path}"]
    spec = build_spec(compose(overrides), overrides, plan=False)
    manager, saved = _Manager(), []

    def save(spec_, mgr, step, cluster, state, metrics=None):
        saved.append((step, state["step"]))
        mgr.last_saved = step
        return tmp_path / f"step_{step}"

    monkeypatch.setattr(ckpt_io, "manager", lambda spec_, run_dir: manager)
    monkeypatch.setattr(ckpt_io, "latest", lambda spec_, run_dir: None)
    monkeypatch.setattr(ckpt_io, "save", save)
    console = SimpleNamespace(print=lambda *a, **k: None, step=lambda *a, **k: None)
    tracker = SimpleNamespace(log=lambda *a, **k: None)
    cluster = SimpleNamespace(actor=_Actor(signum, at_call=3))
    before = signal.getsignal(signum)
    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with pytest.raises(expected):
        supervised.train_epochs(spec, cluster, tracker, console, str(tmp_path), n_units=64, steps_per_epoch=10,
                                shards_of=lambda units: [units], objective=None,
                                step_metrics=lambda stats: {"train/loss": 1.0}, evaluate=lambda: {"eval/loss": 1.0})
    assert cluster.actor.calls == 3  # the third step finished, no fourth began
    assert saved == [(3, 3)]  # one checkpoint, of step 3, though checkpoint.every=0
    assert signal.getsignal(signum) == before  # the loop's handler is gone again
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1 + 3  # eval before + 3 steps


class _PeakActor:
    """Two ranks, as PolicyWorker.train_step returns them on CUDA: its stats and its step's peaks
    (rank 1's grows by one each step)."""

    def __init__(self):
        self.steps = 0

    def scatter(self, method, shards, objective):
        assert method.__name__ == "train_step"
        self.steps += 1
        return [{"loss": 1.0, "n": 1.0, "memory/train_peak_reserved_gib": 0.5, "perf/micro_batch_tokens_max": 64.0},
                {"loss": 1.0, "n": 1.0, "memory/train_peak_reserved_gib": float(self.steps),
                 "perf/micro_batch_tokens_max": 32.0 * self.steps}]


def test_supervised_steps_log_their_own_memory_peaks_on_cuda(tmp_path, monkeypatch):
    """Every step logs the largest rank's peak of that step, and the stats summed over ranks
    without them (the worker leaves out what ran between steps: test_memory_peaks)."""
    import dataclasses
    import json

    from rlhf.cli import build_spec, compose
    from rlhf.ckpt import training as ckpt_io
    from rlhf.loops import supervised

    overrides = ["algo=sft", "algo.epochs=2", "tracking=none", f"output_dir={tmp_path}"]
    spec = build_spec(compose(overrides), overrides, plan=False)
    spec = dataclasses.replace(spec, hardware=dataclasses.replace(spec.hardware, accelerator="cuda"))
    monkeypatch.setattr(ckpt_io, "manager", lambda spec_, run_dir: _Manager())
    monkeypatch.setattr(ckpt_io, "latest", lambda spec_, run_dir: None)
    monkeypatch.setattr(ckpt_io, "save", lambda *a, **k: tmp_path / "ckpt")
    actor = _PeakActor()

    def evaluate():
        return {"eval/loss": 1.0}

    console = SimpleNamespace(print=lambda *a, **k: None, step=lambda *a, **k: None)
    supervised.train_epochs(spec, SimpleNamespace(actor=actor), SimpleNamespace(log=lambda *a, **k: None), console,
                            str(tmp_path), n_units=8, steps_per_epoch=2, shards_of=lambda units: [units], objective=None,
                            step_metrics=lambda stats: {"train/loss": stats["loss"]}, evaluate=evaluate)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/loss"] == 2.0 for r in rows if "train/loss" in r)  # summed over the two ranks
    peaks = [r["memory/train_peak_reserved_gib"] for r in rows if "train/loss" in r]
    # step k's largest rank's peak is k (a sum over ranks would be k + 0.5)
    assert peaks == [float(k) for k in range(1, 2 * spec.algo.epochs + 1)]
    # the largest micro-batch of any rank: 64 tokens, then 64, 96, 128
    tokens = [r["perf/micro_batch_tokens_max"] for r in rows if "train/loss" in r]
    assert tokens == [max(64.0, 32.0 * k) for k in range(1, 2 * spec.algo.epochs + 1)]
