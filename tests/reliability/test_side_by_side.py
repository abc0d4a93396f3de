"""Runs side by side, as a user starts them: real ``python -m rlhf.cli`` processes in one fresh
directory, sharing its ``outputs/mlflow.db``. One scene, shared by the tests of this module:

1. a run on ``outputs/shared`` is SIGKILLed right after it took the run-dir lock (a stale lock);
2. two runs start together: R1 on ``outputs/shared`` (takes the stale lock over, with a warning)
   and R2 in its default run dir, both creating the MLflow store at once;
3. while R1 runs, a second run on ``outputs/shared`` and a ``resume=outputs/shared`` (in this
   process) are each stopped at once with one line naming R1's pid and host;
4. both runs finish: two FINISHED MLflow runs with every step's metrics, R1's metrics equal to R2's
   (same seed, a run alone) on every non-timing key, and no process of theirs left.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_clear, read_metrics
from tests.reliability.conftest import marked_pids

STEPS = 3
TOY = ["algo=grpo", "train.prompts_per_step=4", "algo.group_size=2", "train.micro_batch_size=8",
       "rollout.max_response_tokens=1", "checkpoint.every=1", "checkpoint.save_hf=false", f"train.steps={STEPS}",
       "tracking.console=plain", "ray.num_cpus=2"]  # MLflow tracking on: the default sqlite store
TIMING = ("time/", "throughput/", "perf/")
REPO = str(Path(__file__).resolve().parents[2])


def _owner(lock: Path):
    try:
        return json.loads(lock.read_text()).get("pid")
    except (OSError, ValueError):
        return None


def _wait(cond, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{what}: a run ended early ({p.args[-1]}, exit {p.returncode})"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scene(rlhf_cache, tmp_path_factory):
    # the session's cache but no Ray in this process: the runs start their own, and the two calls
    # made here are refused (the busy lock) before any cluster starts
    from rlhf import cli
    from rlhf.run_lock import LOCK_NAME

    fresh = tmp_path_factory.mktemp("fresh")
    shared = fresh / "outputs" / "shared"
    lock = shared / LOCK_NAME
    marker = f"{os.getpid()}_{time.time_ns()}"
    env = dict(os.environ, RLHF_CACHE=rlhf_cache, PYTHONUNBUFFERED="1", PYTHONPATH=REPO, RLHF_SIDE_MARK=marker)
    env.pop("RAY_ADDRESS", None)
    env.pop("RLHF_TRACKING_DIR", None)  # the CLI's own default: outputs/ of the directory it starts in
    logs = fresh / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "rlhf.cli", *TOY, *args], cwd=fresh, env=env,
                             stdout=open(logs / f"{name}.out", "w"), stderr=open(logs / f"{name}.err", "w"),
                             start_new_session=True)
        procs.append(p)
        return p

    s: dict = {"fresh": fresh, "shared": shared, "logs": logs}
    try:
        killed = start("killed", [f"output_dir={shared}"])
        _wait(lambda: _owner(lock) == killed.pid, 300, "the first run's lock", [killed])
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        for pid in marked_pids(marker):  # anything it had started (it is killed before Ray starts, as a rule)
            os.kill(pid, signal.SIGKILL)
        s["killed_pid"] = killed.pid

        r1 = start("r1", [f"output_dir={shared}"])
        r2 = start("r2", [])  # its default run dir: outputs/<date>/<time>
        s["r1_pid"] = r1.pid
        # R1 holds the lock and has written its spec.yaml and config.yaml (it prints "run dir:" after)
        _wait(lambda: _owner(lock) == r1.pid and "run dir:" in (logs / "r1.out").read_text(), 300, "R1's lock",
              [r1, r2])
        kept = {n: ((shared / n).read_bytes(), (shared / n).stat().st_mtime_ns) for n in ("spec.yaml", "config.yaml")}
        s["second"] = _in_process(cli.main, [*TOY, f"output_dir={shared}"])
        s["resume"] = _in_process(cli.main, [f"resume={shared}"])
        s["r1_running_meanwhile"] = r1.poll() is None and _owner(lock) == r1.pid
        s["untouched"] = kept == {n: ((shared / n).read_bytes(), (shared / n).stat().st_mtime_ns) for n in kept}
        s["r1"], s["r2"] = r1.wait(timeout=600), r2.wait(timeout=600)
        deadline = time.monotonic() + 30
        while marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        s["left"] = marked_pids(marker)
        yield s
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid in marked_pids(marker):
            os.kill(pid, signal.SIGKILL)


def _in_process(main, argv: list[str]) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of ``rlhf.cli.main(argv)`` in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, [ln for ln in err.getvalue().splitlines() if ln.strip()]


def _log(scene, name: str, kind: str = "err") -> str:
    return (scene["logs"] / f"{name}.{kind}").read_text()


def _r2_dir(scene) -> Path:
    dirs = [p.parent for p in (scene["fresh"] / "outputs").glob("*/*/config.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_two_runs_started_together_in_a_fresh_dir_both_finish_with_complete_mlflow_runs(scene):
    from mlflow.tracking import MlflowClient

    for name in ("r1", "r2"):
        assert scene[name] == 0, _log(scene, name)[-3000:]
        assert "Traceback" not in _log(scene, name)
    client = MlflowClient(f"sqlite:///{scene['fresh'] / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rlhf")
    runs = {r.data.tags["rlhf.run_dir"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == sorted(str(d.resolve()) for d in (scene["shared"], _r2_dir(scene)))
    for run in runs.values():
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "reward/mean")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert scene["left"] == []  # no process of either run (Ray included) is left


def test_a_second_run_on_a_busy_output_dir_stops_at_once_naming_the_owner(scene):
    assert scene["r1_running_meanwhile"]
    for key in ("second", "resume"):  # rlhf-run output_dir=<busy>, rlhf-run resume=<busy>
        code, lines = scene[key]
        assert code == 2, lines
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert_clear(lines[0], f"output_dir={scene['shared'].resolve() if key == 'resume' else scene['shared']} "
                     "is in use by another run", f"pid {scene['r1_pid']} on host {socket.gethostname()}",
                     "another output_dir=<path>", "wait for that one to finish")
    assert scene["untouched"]  # R1's spec.yaml and config.yaml: same bytes, not rewritten


def test_the_busy_dirs_run_equals_a_run_alone(scene):
    from rlhf.ckpt import find_latest
    from rlhf.run_lock import LOCK_NAME

    shared, alone = scene["shared"], _r2_dir(scene)
    a, b = read_metrics(shared), read_metrics(alone)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    compared = 0
    for x, y in zip(a, b):
        assert {k for k in x if not k.startswith(TIMING)} == {k for k in y if not k.startswith(TIMING)}
        for k in x:
            if not k.startswith(TIMING):
                assert x[k] == y[k], (x["step"], k, x[k], y[k])
                compared += 1
    assert compared > 3 * 20
    for d in (shared, alone):
        assert find_latest(d).step == STEPS and (d / "final" / "hf" / "config.json").is_file()
        assert not (d / LOCK_NAME).exists()  # released at the end


def test_a_killed_runs_lock_is_taken_over_with_a_warning(scene):
    err = _log(scene, "r1")
    warning = [ln for ln in err.splitlines() if ln.startswith("warning: output_dir=")]
    assert len(warning) == 1, err[-3000:]
    assert_clear(warning[0], f"output_dir={scene['shared']} was locked by pid {scene['killed_pid']}",
                 "no longer running", "taking it over")
    assert scene["r1"] == 0
