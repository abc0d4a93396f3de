"""Tracking against a real ``mlflow server`` on 127.0.0.1 (a free port): the Tracker logs params,
per-step metrics and artifacts over HTTP; the client reads them back; the server is stopped after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    log = open(tmp_path / "server.log", "w")
    # no job runner: with a SQL store and huey installed the server would also start huey consumers
    # (the UI's background jobs, processes that import mlflow), which the tracking API does not use
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen(
        [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300  # ~10 s normally; minutes on a loaded machine
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow server did not answer /health"
            time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_tracker_logs_to_mlflow_server(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from rlhf.run import write_run_dir
    from rlhf.spec.build import config_dict, flatten
    from rlhf.track import Tracker
    from tests.helpers import make_spec

    run_dir = tmp_path / "outputs" / "run"
    spec = make_spec(["algo=grpo", "train.steps=3", f"tracking.uri={mlflow_server}",
                      "tracking.experiment=server-test"], run_dir)
    write_run_dir(spec)
    t = Tracker(spec, str(run_dir), artifacts=(str(run_dir / "spec.yaml"), str(run_dir / "config.yaml")))
    for step in range(3):
        t.log(step, {"reward/mean": 0.1 * step, "time/step": 1.0})
    t.finish("FINISHED")

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.run_dir"] == str(run_dir.resolve())
    for k, v in flatten(config_dict(spec)).items():
        if "token" not in k:  # (secret-looking keys may be redacted)
            assert run.data.params[k] == str(v)[:6000], k
    hist = client.get_metric_history(t.run_id, "reward/mean")
    assert [(m.step, round(m.value, 6)) for m in hist] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    arts = {a.path for a in client.list_artifacts(t.run_id)}
    assert {"spec.yaml", "config.yaml", "overrides.txt", "model_path.txt"} <= arts
    local = client.download_artifacts(t.run_id, "overrides.txt", str(tmp_path / "dl"))
    assert "train.steps=3" in Path(local).read_text()
