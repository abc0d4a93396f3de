"""The run-dir lock (rlhf.run_lock) and the default run dir's claim, without a run: a live owner
stops the next run with one line naming it, a killed owner's lock is taken over with a warning, a
released lock leaves nothing behind, and two runs started in the same second get two dirs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_clear

REPO = str(Path(__file__).resolve().parents[2])


def test_a_live_owner_stops_the_next_run_naming_it(tmp_path):
    from rlhf.run_lock import LOCK_NAME, RunLock
    from rlhf.spec.errors import UserError

    first = RunLock(tmp_path)
    assert first.acquire() is None and first.held
    # flock belongs to the open file, so a second open in this process is a second owner
    with pytest.raises(UserError) as e:
        RunLock(tmp_path).acquire()
    assert_clear(str(e.value), f"output_dir={tmp_path} is in use by another run", f"pid {os.getpid()}",
                 f"on host {socket.gethostname()}", "another output_dir=<path>", "wait for that one to finish")
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path) as again:  # released: free, and no stale-lock warning
        assert again.held


def test_a_killed_owners_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    from rlhf.run_lock import LOCK_NAME, RunLock

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rlhf.run_lock import RunLock; "
         f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held"
        from rlhf.spec.errors import UserError

        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert (tmp_path / LOCK_NAME).exists()  # SIGKILL: no chance to clean up
    lock = RunLock(tmp_path)
    previous = lock.acquire()
    try:
        assert previous["pid"] == holder.pid
        err = capsys.readouterr().err
        assert_clear(err, f"warning: output_dir={tmp_path} was locked by pid {holder.pid}", "no longer running",
                     "taking it over")
    finally:
        lock.release()


def test_two_runs_in_the_same_second_get_two_run_dirs(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from rlhf.cli import run_dir_for

    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"hydra": {"run": {"dir": "outputs/day/12-00-00"}}})
    assert run_dir_for(cfg) == "outputs/day/12-00-00"  # a plan only names it
    assert not (tmp_path / "outputs").exists()
    got = [run_dir_for(cfg, claim=True) for _ in range(3)]
    assert got == ["outputs/day/12-00-00", "outputs/day/12-00-00-1", "outputs/day/12-00-00-2"]
    assert all((tmp_path / g).is_dir() for g in got)


def test_a_spec_that_does_not_build_gives_its_claimed_dir_back(tmp_path, monkeypatch, capsys):
    from rlhf import cli
    from rlhf.config import build

    monkeypatch.chdir(tmp_path)
    claimed = []
    real = build.unique_dir  # what claim_run_dir creates the dir with
    monkeypatch.setattr(build, "unique_dir", lambda name, claim=False: claimed.append(real(name, claim)) or claimed[-1])
    assert cli.main(["train.steps=-1", "tracking.backend=none"]) == 2
    assert len(claimed) == 1 and claimed[0].startswith("outputs")
    assert "train.steps" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()  # claimed (outputs/<date>/<time>), then given back


def test_two_sweeps_in_the_same_second_get_two_sweep_dirs(tmp_path, monkeypatch, capsys):
    import datetime as dt

    import yaml

    from rlhf import cli, sweep
    from rlhf.config import rundir

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir, "datetime", Frozen)
    monkeypatch.setattr(sweep, "execute", lambda spec: 0)  # no training: where the jobs go is the point
    monkeypatch.setattr(sweep, "default_hooks", lambda: [])
    for _ in range(2):
        assert sweep.multirun_main(cli.parse_args(["-m", "train.steps=1,2", "tracking.backend=none"])) == 0
    dirs = sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.glob("multirun/*/*/sweep_results.yaml"))
    assert dirs == ["multirun/2026-01-02/03-04-05", "multirun/2026-01-02/03-04-05-1"]
    jobs = [r["output_dir"] for d in dirs for r in yaml.safe_load((tmp_path / d / "sweep_results.yaml").read_text())]
    assert len(set(jobs)) == 4
