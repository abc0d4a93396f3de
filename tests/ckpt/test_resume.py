"""Kill an RL run after a checkpoint (SIGKILL of the driver's whole process group, Ray included),
resume it with ``rlhf-run resume=<run dir>``, and compare every step's metrics with an
uninterrupted run of the same config: equal within 1e-6 (timing metrics excluded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


@pytest.mark.timeout(900)
def test_killed_and_resumed_run_equals_uninterrupted(rl_env, tmp_path):
    from rlhf.ckpt import find_latest

    cache = tmp_path / "cache"
    full, killed = tmp_path / "full", tmp_path / "killed"
    b = _start(TOY + [f"output_dir={killed}"], cache, tmp_path / "killed.log")
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            latest = find_latest(killed)
            if latest is not None and latest.step == KILL_AFTER and any(r["step"] >= KILL_AFTER for r in read_metrics(killed)):
                break
            assert b.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.1)
        else:
            pytest.fail("no checkpoint in time: " + (tmp_path / "killed.log").read_text()[-3000:])
        assert b.poll() is None  # still running: killed mid-run, after step KILL_AFTER + 1 was logged
        _kill_group(b)
        assert any(r["step"] == KILL_AFTER for r in read_metrics(killed))  # a step past the checkpoint was lost
    finally:
        if b.poll() is None:
            _kill_group(b)

    c = _start([f"resume={killed}"], cache, tmp_path / "resume.log")
    try:
        # meanwhile the uninterrupted reference, in this process on the session's Ray (the
        # built-in model comes from a fixed seed, so which cache dir holds it does not matter)
        code, _ = run_rl([t for t in TOY if not t.startswith("ray.")], full)
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
