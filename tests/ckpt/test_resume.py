"""Kill an RL run after a checkpoint (SIGKILL of the driver's whole process group, Ray included),
resume it with ``rlhf-run resume=<run dir>``, and compare every step's metrics with an
uninterrupted run of the same config: equal within 1e-6 (timing metrics excluded).

The same two runs then serve the checkpoint manifest's tests: every file of a real checkpoint
(DeepSpeed state, HF export, driver state, marker) cut short and with a byte changed is named; a
corrupt newest checkpoint is set aside and the run resumes from the one before, its metrics again
equal to the uninterrupted run's; a finished run dir rerun starts nothing."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
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
        # the driver's process group (the reward process, a child of the driver, has a session of its own)
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    return keymap_reward(prompts, responses, **meta)
'''


@pytest.fixture(scope="module")
def runs(rl_env, tmp_path_factory):
    """The killed-and-resumed run and the uninterrupted one: (killed run dir, full run dir, log of
    the resume, the full run's metrics as it ended)."""
    from rlhf.ckpt import find_latest

    tmp_path = tmp_path_factory.mktemp("resume")
    cache = Path(rl_env)  # the session's: builtin:tiny built once
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
    assert [r["step"] for r in read_metrics(killed)] == list(range(1, KILL_AFTER + 2))

    # the uninterrupted reference, then the resume, both in this process on the session's Ray; the
    # resume is what ``rlhf-run resume=<dir>`` runs, its console captured as the log
    code, _ = run_rl([t for t in toy if not t.startswith("ray.")], full)
    assert code == 0
    from rlhf.cli import main

    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = main([f"resume={killed}"])
    assert code == 0, log.getvalue()[-3000:]
    return killed, full, log.getvalue(), read_metrics(full)


def _assert_same_metrics(ref: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1)) and [r["step"] for r in got] == list(range(1, STEPS + 1))
    compared = 0
    for x, y in zip(ref, got):
        keys = {k for k in x if not k.startswith(TIMING)} | {k for k in y if not k.startswith(TIMING)}
        for k in sorted(keys):
            assert k in x and k in y, (x["step"], k)
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
            compared += 1
    assert compared > 20


@pytest.mark.timeout(900)
def test_killed_and_resumed_run_equals_uninterrupted(runs):
    from rlhf.ckpt import find_latest

    killed, full, log, ref = runs
    assert f"resumed from {killed / 'checkpoints' / 'step_00000002'} at step 3" in log
    _assert_same_metrics(ref, read_metrics(killed))
    # the resumed run ends like any run: final HF export, newest checkpoints kept
    assert (killed / "final" / "hf" / "config.json").is_file()
    assert find_latest(killed).step == STEPS
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(killed / "final" / "hf"))


@pytest.mark.timeout(900)
def test_every_file_of_a_real_checkpoint_cut_short_or_changed_is_named(runs, tmp_path):
    from rlhf.ckpt import verify

    _, full, _, _ = runs
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(full / "checkpoints" / "step_00000004", ckpt)
    assert verify(ckpt) is None
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    roles = {f.relative_to(ckpt).parts[0] for f in files}
    assert {"driver.pt", "COMPLETE", "actor"} <= roles and any("hf" in f.parts for f in files)
    checked = 0
    for f in files:
        rel, data = f.relative_to(ckpt).as_posix(), f.read_bytes()
        if not data:
            continue
        mid = len(data) // 2
        for broken in (data[:mid], data[:mid] + bytes([data[mid] ^ 0x10]) + data[mid + 1:]):
            f.write_bytes(broken)
            why = verify(ckpt)
            assert why is not None and rel in why, (rel, why)
            checked += 1
        f.write_bytes(data)
    assert checked >= 2 * (len(files) - 1) and verify(ckpt) is None


@pytest.mark.timeout(900)
def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before(runs, tmp_path, capsys):
    """Step 4's DeepSpeed state cut short: the resume names it, sets it aside, continues from step
    2 (before any cluster starts), and ends with the metrics of the uninterrupted run."""
    from rlhf.config import resume_spec
    from rlhf.run import run

    _, full, _, ref = runs
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    state = sorted((run_dir / "checkpoints" / "step_00000004" / "actor").rglob("*model_states.pt"))[0]
    size = state.stat().st_size
    state.write_bytes(state.read_bytes()[:-100])
    assert run(resume_spec(str(run_dir), [])) == 0
    out = capsys.readouterr().out
    rel = state.relative_to(run_dir / "checkpoints" / "step_00000004").as_posix()
    assert (f"warning: checkpoint step_00000004 is corrupt ({rel} is {size - 100} bytes, the manifest "
            f"says {size}): set aside as {run_dir / 'checkpoints' / 'step_00000004.corrupt'}; "
            "resuming from step_00000002, the newest intact one") in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 3" in out
    _assert_same_metrics(ref, read_metrics(run_dir))
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


@pytest.mark.timeout(900)
def test_a_finished_run_dir_rerun_starts_nothing(runs, tmp_path, capsys, monkeypatch):
    import rlhf.launch
    from rlhf.config import resume_spec
    from rlhf.run import run

    _, full, _, _ = runs
    run_dir = tmp_path / "done"
    shutil.copytree(full, run_dir)
    monkeypatch.setattr(rlhf.launch, "start_cluster", lambda spec: pytest.fail("a cluster started"))
    before = (run_dir / "metrics.jsonl").read_text()
    assert run(resume_spec(str(run_dir), [])) == 0
    out = capsys.readouterr().out
    assert f"{run_dir} has finished all {STEPS} steps (checkpoint step_00000004" in out and "nothing to run" in out
    assert (run_dir / "metrics.jsonl").read_text() == before
    # every checkpoint corrupt: one line, exit 2, nothing started
    for d in (run_dir / "checkpoints").glob("step_*"):
        (d / "driver.pt").write_bytes(b"")
    assert run(resume_spec(str(run_dir), [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: no intact checkpoint in {run_dir / 'checkpoints'}: ")
