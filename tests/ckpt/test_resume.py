"""Kill an RL run after a checkpoint (SIGKILL of the driver's whole process group, Ray included),
resume it with ``rlhf-run resume=<run dir>``, and compare every step's metrics with an
uninterrupted run of the same config: equal within 1e-6 (timing metrics excluded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_metrics, run_rl

STEPS, EVERY, KILL_AFTER = 4, 2, 2  # checkpoint after steps 2 and 4; kill once step index 2 is logged
TOY = ["algo=grpo", f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "train.prompts_per_step=16",
       "rollout.max_response_tokens=4", "train.seed=1", "tracking=none", "tracking.console=plain",
       "ray.num_cpus=4"]
TIMING = ("time/", "throughput/", "perf/")


def _env(cache: Path) -> dict:
    env = dict(os.environ, RLHF_CACHE=str(cache), PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    return env


def _start(args: list[str], cache: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlhf.cli", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=_env(cache), start_new_session=True,
                            cwd=str(Path(__file__).resolve().parents[2]))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


# The crash comes from inside the run, at a fixed point, not from a poll racing it (a toy step
# takes 0.07 s): while the arm file exists, the reward's 4th call (step 4's scoring, after step 3
# was logged and the step-2 checkpoint written) SIGKILLs the driver's process group, Ray included.
CRASHER = '''
import os, signal
from rlhf.rewards.builtin import keymap_reward

calls = 0


def reward(prompts, responses, **meta):
    global calls
    calls += 1
    if calls == {crash_on} and os.path.exists({arm!r}):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    return keymap_reward(prompts, responses, **meta)
'''


@pytest.mark.timeout(900)
def test_killed_and_resumed_run_equals_uninterrupted(rl_env, tmp_path):
    from rlhf.ckpt import find_latest

    cache = tmp_path / "cache"
    full, killed = tmp_path / "full", tmp_path / "killed"
    arm = tmp_path / "arm"
    arm.write_text("1")
    crasher = tmp_path / "crasher.py"
    crasher.write_text(CRASHER.format(crash_on=KILL_AFTER + 2, arm=str(arm)))
    toy = TOY + [f"reward.functions=[{{fn: '{crasher}:reward', name: keymap}}]"]
    b = _start(toy + [f"output_dir={killed}"], cache, tmp_path / "killed.log")
    try:
        assert b.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    finally:
        if b.poll() is None:
            _kill_group(b)
    arm.unlink()  # the resumed run and the reference run score without crashing
    assert find_latest(killed).step == KILL_AFTER
    # step KILL_AFTER + 1 (0-based index KILL_AFTER) was logged past the checkpoint, and is lost
    assert [r["step"] for r in read_metrics(killed)] == list(range(KILL_AFTER + 1))

    c = _start([f"resume={killed}"], cache, tmp_path / "resume.log")
    try:
        # meanwhile the uninterrupted reference, in this process on the session's Ray (the
        # built-in model comes from a fixed seed, so which cache dir holds it does not matter)
        code, _ = run_rl([t for t in toy if not t.startswith("ray.")], full)
        assert code == 0
        assert c.wait(timeout=600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    finally:
        if c.poll() is None:
            _kill_group(c)
    log = (tmp_path / "resume.log").read_text()
    assert f"resumed from {killed / 'checkpoints' / 'step_00000002'} at step 3" in log

    ref, got = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in ref] == list(range(STEPS)) and [r["step"] for r in got] == list(range(STEPS))
    compared = 0
    for x, y in zip(ref, got):
        keys = {k for k in x if not k.startswith(TIMING)} | {k for k in y if not k.startswith(TIMING)}
        for k in sorted(keys):
            assert k in x and k in y, (x["step"], k)
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
            compared += 1
    assert compared > 20
    # the resumed run ends like any run: final HF export, newest checkpoints kept
    assert (killed / "final" / "hf" / "config.json").is_file()
    assert find_latest(killed).step == STEPS
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(killed / "final" / "hf"))
