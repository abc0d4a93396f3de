"""Per-worker log files (rlhf.track.worker_logs), in a subprocess standing in for a Ray worker:
what Python, C code (a raw write to fd 2), a child process and the warnings module print all land
in <run dir>/logs/<role>_<rank>.log and none of it on the process's own stdout/stderr (what Ray
would forward to the console); a second role in the same process renames the file; verbose
leaves everything on the console. The set-up summary reads vLLM's timing lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import os, subprocess, sys, warnings
from types import SimpleNamespace
from rlhf.track.worker_logs import log_to_file
spec = SimpleNamespace(run_dir=sys.argv[1], tracking=SimpleNamespace(console=sys.argv[2]))
print("before the redirect")
log_to_file(spec, "rollout", 0)
print("from python")
os.write(2, b"from C-level stderr\\n")
subprocess.run(["sh", "-c", "echo from a child process"])
warnings.warn("a torch-like warning")
log_to_file(spec, "reference", 0)
print("after the rename")
"""
SAID = ["from python", "from C-level stderr", "from a child process", "a torch-like warning", "after the rename"]


def _worker(tmp_path: Path, console: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "run"), console], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_quiet_worker_writes_everything_to_its_file(tmp_path):
    p = _worker(tmp_path, "plain")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "before the redirect\n" and p.stderr == ""  # nothing after the redirect
    (log,) = (tmp_path / "run" / "logs").iterdir()
    assert log.name == "rollout+reference_0.log"
    text = log.read_text()
    assert text.startswith("# rollout rank 0 · pid ")
    for line in SAID:
        assert line in text, line
    assert "# also reference rank 0 in this process" in text


def test_verbose_leaves_the_output_on_the_console(tmp_path):
    p = _worker(tmp_path, "verbose")
    assert p.returncode == 0, p.stderr
    for line in SAID:
        assert line in p.stdout + p.stderr, line
    assert not (tmp_path / "run" / "logs").exists()


def test_setup_line_reads_vllms_timings(tmp_path):
    from rlhf.track.worker_logs import latest_line, setup_line

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "rollout_0.log").write_text(
        "# rollout rank 0\n"
        "(EngineCore_DP0 pid=1) INFO 10-06 12:00:20 [gpu_model_runner.py:2602] Model loading took 15.27 GiB and 12.5 seconds\n"
        "INFO 10-06 12:00:40 [gpu_model_runner.py:3480] Graph capturing finished in 8 secs, took 0.31 GiB\n"
        "INFO 10-06 12:00:41 [core.py:210] init engine (profile, create kv cache, warmup model) took 41.37 seconds\n")
    (logs / "actor_0.log").write_text("# actor rank 0\nnothing timed here\n")
    spec = SimpleNamespace(run_dir=str(tmp_path / "run"), tracking=SimpleNamespace(console="plain"))
    assert setup_line(spec) == "set-up · rollout_0: model load 12.5 s, CUDA graphs 8.0 s, engine start 41.4 s"
    import os

    os.utime(logs / "actor_0.log", (1, 1))  # the rollout log is the newest: its last line is the news
    assert latest_line(tmp_path / "run", width=60) == "rollout_0: INFO 10-06 12:00:41 [core.py:210] init engine (p…"
    assert setup_line(SimpleNamespace(run_dir=str(tmp_path / "run"), tracking=SimpleNamespace(console="verbose"))) == ""


@pytest.mark.parametrize("value,ok", [("verbose", True), ("loud", False)])
def test_console_verbose_is_a_choice(value, ok, tmp_path):
    from rlhf.cli import build_spec, compose
    from rlhf.spec.errors import SpecError

    ov = [f"tracking.console={value}", f"output_dir={tmp_path / 'r'}"]
    if ok:
        assert build_spec(compose(ov), ov, plan=False).tracking.console == "verbose"
    else:
        with pytest.raises(SpecError, match="tracking.console='loud' is not valid. Choose one of: rich, plain, verbose, none"):
            build_spec(compose(ov), ov, plan=False)


def test_the_live_line_shows_what_the_workers_are_doing(tmp_path):
    """While the cluster starts, the rich progress line carries the newest worker-log line."""
    import io
    import time

    from rlhf.track import Console

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    logs = tmp_path / "logs"
    logs.mkdir()
    console = Console("rich", 3, stream=Terminal())
    try:
        with console.status("starting the cluster", str(tmp_path)):
            (logs / "rollout_0.log").write_text("# rollout rank 0\nCapturing CUDA graphs (decode, FULL): 40%\n")
            deadline = time.monotonic() + 10
            while "Capturing" not in console._progress.tasks[0].fields["info"] and time.monotonic() < deadline:
                time.sleep(0.1)
            info = console._progress.tasks[0].fields["info"]
        assert info.startswith("starting the cluster ") and info.endswith(
            "· rollout_0: Capturing CUDA graphs (decode, FULL): 40%")
        assert console._progress.tasks[0].fields["info"] == ""  # cleared when the block ends
    finally:
        console.close()


def test_plain_status_is_one_line(capsys):
    from rlhf.track import Console

    console = Console("plain", 3)
    with console.status("starting the cluster", "/nonexistent"):
        pass
    assert capsys.readouterr().out == "starting the cluster\n"


NCCL_WATCHDOG = ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=1, "
                 "NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.")


def test_a_dead_workers_last_words_are_read_from_its_log_file(rl_env, tmp_path):
    """torch's NCCL watchdog prints its cause on stderr and ends the process: with the worker's
    stderr in its log file, rlhf.launch.failures still finds that line (tail_for_actor)."""
    import ray

    from rlhf.launch.failures import timeout_in
    from rlhf.track.worker_logs import tail_for_actor

    spec = SimpleNamespace(run_dir=str(tmp_path / "run"), tracking=SimpleNamespace(console="plain"))

    @ray.remote(num_cpus=0)
    class Dying:
        def __init__(self, spec):
            from rlhf.track.worker_logs import log_to_file

            log_to_file(spec, "actor", 2)

        def die(self, text):
            import os
            import sys

            sys.stderr.write(f"terminate called after throwing an instance of 'c10::DistBackendError'\n  what(): {text}\n")
            sys.stderr.flush()
            os._exit(134)

    a = Dying.remote(spec)
    actor_id = a._actor_id.hex()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(a.die.remote(NCCL_WATCHDOG))
    found = timeout_in(tail_for_actor(spec, actor_id))
    assert found is not None and found[:2] == (600.0, "NCCL") and "WorkNCCL(SeqNum=41" in found[2]
    assert tail_for_actor(spec, "ffffffffffffffffffffffff01000000") == ""  # no such actor


def test_the_rollout_workers_imports_reach_the_setup_line(tmp_path, monkeypatch, capsys):
    """RolloutWorker.prepare (vLLM's imports, before the engines wait for the models) prints its seconds
    into the worker's log; the set-up line reads them first, beside vLLM's own timings."""
    from rlhf.track.worker_logs import setup_line
    from rlhf.workers import rollout

    monkeypatch.setattr(rollout.registry, "kind", lambda spec: SimpleNamespace(prepare=lambda: True))
    rollout.RolloutWorker.prepare(SimpleNamespace(spec=None))
    printed = capsys.readouterr().out
    monkeypatch.setattr(rollout.registry, "kind", lambda spec: SimpleNamespace(prepare=lambda: False))
    rollout.RolloutWorker.prepare(SimpleNamespace(spec=None))
    assert capsys.readouterr().out == ""  # an engine kind with nothing to prepare (HF) says nothing
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "rollout_1.log").write_text(
        "# rollout rank 1\n" + printed +
        "INFO 12-07 21:50:22 [core.py:340] init engine (profile, create kv cache, warmup model) took 10.2 s\n")
    spec = SimpleNamespace(run_dir=str(tmp_path / "run"), tracking=SimpleNamespace(console="plain"))
    assert re.fullmatch(r"set-up · rollout_1: imports \d+\.\d s, engine start 10\.2 s", setup_line(spec)), setup_line(spec)
