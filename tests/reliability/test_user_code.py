"""User code that ends its own process: a reward function calling ``os._exit``, crashing in C
(SIGSEGV through ctypes), allocating past the reward process's memory cap (``reward.memory_gb=2``,
a 4 GB ``bytearray``: refused at once, no page touched), or calling ``sys.exit(0)``.

Each is a real RL run (two steps, the shared Ray) whose reward function behaves in the preflight
call and in step 1 and fails in step 2. The run ends with exactly one ``error:`` line naming the
function and what happened, exit code 2; step 1 is checkpointed (``checkpoint.every=0``, so only
the failure saved it) and the line says how to continue; no actor, placement group or reward
process is left; the run dir's lock is gone and can be taken again; the MLflow run is FAILED.
The unit tests of the reward process itself (no run) are at the end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.helpers import leftovers, run_rl, snapshot

TOY = ["algo=grpo", "train.prompts_per_step=2", "algo.group_size=2", "train.micro_batch_size=4",
       "rollout.max_response_tokens=1", "train.steps=2", "checkpoint.every=0", "checkpoint.save_hf=false"]

REWARD = '''
import ctypes, os, sys

CALLS = [0]  # calls in this process: the preflight's process makes one, the run's process one per step


def reward(prompts, responses, **meta):
    CALLS[0] += 1
    if CALLS[0] == 2:
{fault}
    return [float(len(r)) for r in responses]
'''

FAULTS = {
    "os_exit": ("        os._exit(7)", ["ended its process (exit code 7: os._exit"]),
    "segfault": ("        ctypes.string_at(0)", ["crashed its process (SIGSEGV, a segmentation fault"]),
    "memory": ("        blob = bytearray(4 * 2**30)", ["ran out of memory", "reward.memory_gb=2 (MemoryError at ",
                                                      "raise reward.memory_gb"]),
    "sys_exit": ("        sys.exit(0)", ["called sys.exit(0) (at "]),
}


def reward_processes() -> list[int]:
    """This process's children that are reward processes (``rlhf.rewards.isolated``)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "rlhf.rewards.isolated" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.mark.parametrize("fault", [
    "os_exit",
    # the same path after the reward process's line (test_each_fault_is_one_line_and_leaves_no_process
    # below covers each fault's line and that no process is left, os_exit the run's path): -m slow
    pytest.param("segfault", marks=pytest.mark.slow), pytest.param("memory", marks=pytest.mark.slow),
    pytest.param("sys_exit", marks=pytest.mark.slow)])
def test_user_code_that_ends_its_process_is_one_line_and_the_run_ends_clean(rl_env, tmp_path, capsys, store, fault):
    body, parts = FAULTS[fault]
    f = tmp_path / f"{fault}.py"
    f.write_text(REWARD.format(fault=body))
    ref = f"{f}:reward"
    out = tmp_path / "run"
    before = snapshot()
    code, rows = run_rl(TOY + [f"reward.functions=[{{fn: '{ref}'}}]", "reward.memory_gb=2",
                               "tracking.backend=mlflow", f"tracking.uri={store}",
                               f"tracking.experiment=user_code_{fault}"], out)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"error: reward function {ref} "), line
    for p in parts:
        assert p in line, (p, line)
    assert "Step 1 is checkpointed: fix it, then continue with rlhf-run resume=" in line, line
    # what it had: step 1, checkpointed by the failure alone (checkpoint.every=0)
    assert [r["step"] for r in rows] == [1]  # counted from 1, as the console and the checkpoint
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000001"], ckpts
    assert (out / "checkpoints" / "step_00000001" / "COMPLETE").is_file()
    # nothing left: actors, placement groups, the reward process; the lock released
    assert leftovers(*before) == ([], [])
    assert reward_processes() == []
    assert not (out / ".rlhf-run.lock").exists()
    from rlhf.run_lock import RunLock

    lock = RunLock(out)
    lock.acquire()
    lock.release()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name(f"user_code_{fault}")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


# ----------------------------------------------------------------------------- the reward process alone


def _rewards(tmp_path, body: str, **spec):
    from rlhf.rewards import Rewards

    f = tmp_path / "r.py"
    f.write_text("import os\n\ndef reward(prompts, responses, **kw):\n" + body + "\n")
    spec = SimpleNamespace(**{"functions": [SimpleNamespace(fn=f"{f}:reward", weight=1.0, name=None)],
                              "timeout_s": 60.0, "remote": None, **spec})
    return Rewards(spec), f"{f}:reward"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_one_line_and_leaves_no_process(tmp_path, fault):
    from rlhf.rewards import RewardError, Rewards

    body, parts = FAULTS[fault]
    f = tmp_path / "r.py"
    f.write_text(REWARD.format(fault=body))
    rewards = Rewards(SimpleNamespace(
        functions=[SimpleNamespace(fn=f"{f}:reward", weight=1.0, name=None)], timeout_s=60.0, remote=None,
        memory_gb=2))
    try:
        assert rewards.score(["p"], ["ab"], {})[0] == [2.0]
        with pytest.raises(RewardError) as e:
            rewards.score(["p"], ["ab"], {})
    finally:
        rewards.close()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"reward function {f}:reward "), line
    for p in parts:
        assert p in line, (p, line)
    assert reward_processes() == []


def test_reward_functions_run_in_another_process_with_the_drivers_path_and_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rewards, _ = _rewards(tmp_path, "    return [float(os.getpid()), float(os.getcwd() == " + repr(str(tmp_path))
                          + ")] + [0.0] * (len(responses) - 2)")
    try:
        total, _ = rewards.score(["p"] * 3, ["a", "b", "c"], {})
        assert int(total[0]) == rewards.executor.pid != os.getpid()
        assert total[1] == 1.0
    finally:
        rewards.close()
    assert reward_processes() == []


def test_isolate_false_runs_them_in_the_driver(tmp_path):
    rewards, _ = _rewards(tmp_path, "    return [float(os.getpid())] * len(responses)", isolate=False)
    try:
        assert rewards.score(["p"], ["a"], {})[0] == [float(os.getpid())]
    finally:
        rewards.close()


def test_isolate_auto_runs_the_projects_own_in_the_driver_and_yours_in_the_process(tmp_path, monkeypatch):
    """reward.isolate=auto (the default): a function of an rlhf module (the package's own, e.g. the
    built-in task's) runs in the driver, so a run with only those starts no reward process; a
    user's file, even one named like the package's module, runs in the process."""
    import rlhf.rewards.math as project
    from rlhf.rewards import Rewards

    def pid_reward(prompts, responses, **metadata):
        return [float(os.getpid())] * len(responses)

    monkeypatch.setattr(project, "pid_reward", pid_reward, raising=False)
    own = SimpleNamespace(fn="rlhf.rewards.math:pid_reward", weight=1.0, name="own")
    alone = Rewards(SimpleNamespace(functions=[own], timeout_s=60.0, remote=None, isolate="auto"))
    try:
        assert alone.score(["p"], ["a"], {})[0] == [float(os.getpid())]
        assert alone.executor.pid is None and reward_processes() == []  # never started
    finally:
        alone.close()
    f = tmp_path / "rlhf" / "rewards" / "math.py"  # a path is the user's, wherever it is
    f.parent.mkdir(parents=True)
    f.write_text("import os\n\ndef reward(prompts, responses, **kw):\n"
                 "    return [float(os.getpid())] * len(responses)\n")
    both = Rewards(SimpleNamespace(functions=[own, SimpleNamespace(fn=f"{f}:reward", weight=1.0, name="yours")],
                                   timeout_s=60.0, remote=None))  # isolate not given: auto
    try:
        _, parts = both.score(["p"], ["a"], {})
        assert parts["own"] == [float(os.getpid())]
        assert parts["yours"] == [float(both.executor.pid)] and both.executor.pid != os.getpid()
    finally:
        both.close()
    assert reward_processes() == []
    # true: the project's own run in the process too
    arith = SimpleNamespace(fn="rlhf.rewards.math:arith_reward", weight=1.0, name=None)
    isolated = Rewards(SimpleNamespace(functions=[arith], timeout_s=60.0, remote=None, isolate=True))
    try:
        assert isolated.score(["p"], ["2"], {"answer": ["2"]})[0] == [1.0]
        assert isolated.executor.pid not in (None, os.getpid())
    finally:
        isolated.close()


def test_a_reward_process_that_died_is_started_again_for_the_next_call(tmp_path):
    marker = tmp_path / "died"
    rewards, ref = _rewards(tmp_path, f"    if not os.path.exists({str(marker)!r}):\n"
                                      f"        open({str(marker)!r}, 'w').close()\n        os._exit(1)\n"
                                      "    return [1.0] * len(responses)")
    try:
        first = rewards.executor.pid
        with pytest.raises(Exception, match="ended its process"):
            rewards.score(["p"], ["a"], {})
        assert rewards.score(["p"], ["a"], {})[0] == [1.0]
        assert rewards.executor.pid != first
    finally:
        rewards.close()


def test_the_reward_process_dies_with_the_driver(tmp_path):
    """A driver SIGKILLed mid-call leaves no reward process (PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    f = tmp_path / "slow.py"
    f.write_text("import time\n\ndef reward(prompts, responses, **kw):\n    time.sleep(600)\n")
    script.write_text(
        "import sys\nfrom types import SimpleNamespace\nfrom rlhf.rewards import Rewards\n"
        f"r = Rewards(SimpleNamespace(functions=[SimpleNamespace(fn={str(f) + ':reward'!r}, weight=1.0, name=None)],"
        " timeout_s=900, remote=None))\nprint(r.executor.pid, flush=True)\nr.score(['p'], ['a'], {})\n")
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root))
    child = int(proc.stdout.readline())
    assert psutil.pid_exists(child)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
