"""Faults during a run: a worker process killed mid-step, Ctrl-C on the driver.

* kill: a reward function (which runs between generation and the update) SIGKILLs
  the actor's or a rollout engine's Ray worker process at step 3. The driver names the role that
  died, exits 1, leaves the step-2 checkpoint intact, and no actor or placement group of the run
  is left; a rerun of the same run dir continues from that checkpoint (auto-resume).
* Ctrl-C: ``rlhf-run recipe=grpo_tiny`` at toy size (``checkpoint.every=0``) in a subprocess gets
  SIGINT after its second step: it finishes the step it is in, checkpoints it, exits 130
  ("interrupted"), and no process of its Ray (raylet, workers) is left (found by a marker in their
  environment); ``resume=`` of the run dir continues from that checkpoint to the end (exit 0,
  metrics, checkpoint, final/hf). This is also the run of the grpo_tiny recipe that
  tests/recipes/test_recipes.py counts on. The SIGINT/SIGTERM handling itself
  (``rlhf.run.StopRequest``: first signal = stop after the step, second = stop now) is tested
  without a run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import marked_pids

from tests.helpers import leftovers, run_rl, snapshot

TOY = ["algo=grpo", "train.prompts_per_step=4", "algo.group_size=2", "train.micro_batch_size=8",
       "rollout.max_response_tokens=1", "tracking.backend=none", "checkpoint.every=1", "checkpoint.save_hf=false"]

KILLER = '''
import os, signal
from pathlib import Path

import psutil

from rlhf.rewards.builtin import keymap_reward

ARM = Path({arm!r})
CALLS = [0]


def reward(prompts, responses, **meta):
    CALLS[0] += 1
    if ARM.exists() and CALLS[0] == 3:  # step 3, after generation, before the update
        # the driver's Ray processes (this function runs in the reward process, a child of the driver)
        for p in psutil.Process(os.getppid()).children(recursive=True):
            try:
                if " ".join(p.cmdline()).startswith(("ray::{cls}", "ray::Host")):
                    os.kill(p.pid, signal.SIGKILL)
            except psutil.Error:
                pass
    return keymap_reward(prompts, responses, **meta)
'''


@pytest.mark.parametrize("role,cls,resume", [
    ("actor", "PolicyWorker", False),
    # a process per role (disaggregated): the line names the rollout engine alone
    pytest.param("rollout", "RolloutWorker", False, marks=pytest.mark.slow),
    pytest.param("actor", "PolicyWorker", True, marks=pytest.mark.slow),  # kill, then resume: two runs
], ids=["actor", "rollout", "actor-then-resume"])
def test_killed_worker_is_named_checkpoint_kept_nothing_left(rl_env, tmp_path, capsys, role, cls, resume):
    arm = tmp_path / "arm"
    arm.write_text("1")
    killer = tmp_path / f"killer_{role}.py"
    killer.write_text(KILLER.format(arm=str(arm), cls=cls))
    out = tmp_path / "run"
    args = TOY + ["train.steps=4", f"reward.functions=[{{fn: '{killer}:reward'}}]"]
    if role == "rollout":
        args += ["placement=disaggregated", "hardware.devices_per_node=3"]
    before = snapshot()
    code, rows = run_rl(args, out)
    err = capsys.readouterr().err
    assert code == 1, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    # CPU hybrid holds every role in one process per device (rlhf.launch.group.Host): killing the
    # actor's process kills the rollout engine's too, and the line names both
    assert len(line) == 1 and " died during the " in line[0] and " of step 3: " in line[0], err
    assert line[0].startswith("error: rollout engine 0 died" if role == "rollout" else
                              "error: the process holding the actor, reference and rollout workers (rank 0) died"), err
    assert role in line[0].split("died")[0], err
    assert "Traceback" not in err
    assert len(rows) == 2  # steps 1 and 2 finished
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000001", "step_00000002"] or ckpts == ["step_00000002"] or \
        ckpts[-1] == "step_00000002", ckpts
    last = out / "checkpoints" / "step_00000002"
    assert (last / "COMPLETE").is_file() and (last / "driver.pt").is_file()
    assert f"Last checkpoint: {last}" in line[0]
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert leftovers(*before) == ([], [])
    if not resume:
        return
    # the same run dir again (no kill): continues from step 2 and ends at step 4
    arm.unlink()
    code, rows = run_rl(args, out)
    err = capsys.readouterr()
    assert code == 0, err.err
    assert "resumed from" in err.out and "step_00000002" in err.out
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert leftovers(*before) == ([], [])


def test_stop_request_first_signal_waits_second_stops_now():
    from rlhf.run import StopRequest, Terminated

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopRequest().install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # the first: recorded, nothing raised
        for _ in range(100):
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.requested and isinstance(stop.exception(), Terminated)
        with pytest.raises(KeyboardInterrupt) as e:  # the second: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert not isinstance(e.value, Terminated)
    finally:
        stop.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


STOP_AFTER = 2  # SIGINT once this many steps are in metrics.jsonl


def test_ctrl_c_checkpoints_the_step_exits_130_leaves_no_ray_process_and_resumes(rl_env, tmp_path, capsys):
    from rlhf.ckpt import find_latest

    marker = f"RLHF_RELIABILITY_MARK={os.getpid()}_{time.time_ns()}"
    env = dict(os.environ, RLHF_RELIABILITY_MARK=marker.split("=", 1)[1], RLHF_CACHE=str(rl_env),
               PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "run"
    # the grpo_tiny recipe at toy size, no periodic checkpoint: the only one is Ctrl-C's
    args = ["recipe=grpo_tiny"] + [a for a in TOY if not a.startswith(("checkpoint.every=", "algo="))]
    cmd = [sys.executable, "-m", "rlhf.cli", *args, "train.steps=200", f"output_dir={out}",
           "tracking.console=plain", "ray.num_cpus=2"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= STOP_AFTER:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert marker.split("=", 1)[1] and marked_pids(marker)  # its Ray processes are there
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: cleaning up" in err
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 30
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = marked_pids(marker)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left if Path(f"/proc/{p}").exists()]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and STOP_AFTER <= len(steps) < 200
    # the step under way when the signal came was finished and checkpointed: the last one logged
    last = find_latest(out)
    assert last is not None and last.step == len(steps), (last, len(steps))
    assert (last.path / "driver.pt").is_file() and not list((out / "checkpoints").glob("*.tmp"))
    assert f"stopped after step {last.step}: continue with rlhf-run resume={out}" in stdout
    assert not (out / "final").exists()  # not the end of the run: no final export

    # resume= continues from it (here to two steps more than were done) and ends like any run
    from rlhf.cli import main

    capsys.readouterr()
    end = last.step + 2
    assert main([f"resume={out}", f"train.steps={end}", "tracking.console=plain"]) == 0
    assert f"resumed from {last.path} at step {last.step + 1}" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, end + 1))
    assert find_latest(out).step == end and (out / "final" / "hf" / "config.json").is_file()
