"""TensorBoard and W&B beside MLflow, and the run report: one real CPU run logs to all three, and each
is read back from what it wrote (event files; the offline W&B run's transaction log; MLflow's store)
— same metric names and steps as metrics.jsonl, the config recorded; the same run's report (PNG +
HTML under the run dir and in MLflow) is decoded and its panels checked. A tracker that fails (its
folder cannot be made, credentials refused, a write error mid-run) is dropped with one line and the
run goes on."""

from __future__ import annotations

import contextlib
import glob
import io
from pathlib import Path

import pytest

from tests.helpers import make_spec, run_rl
from tests.track import tb_events, wandb_log

TRACKED = ["algo=grpo", "train.steps=3", "train.prompts_per_step=16", "rollout.max_response_tokens=4",
           "train.seed=1", "eval.every=2", "tracking.backend=[mlflow,tensorboard,wandb]",
           "checkpoint.push_to_hub=org/tracked", "tracking.report=true"]


@pytest.fixture(scope="module")
def tracked_run(rl_env, tmp_path_factory):
    """The shared run; it ends by pushing final/hf to a stand-in Hub (tests/hub/hubserver.py)."""
    from tests.hub.hubserver import HubServer

    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    out = tmp_path_factory.mktemp("tracked") / "outputs" / "run"
    hub = HubServer({}, token="hf_tracked")
    console = io.StringIO()
    try:
        mp.setenv("HF_ENDPOINT", hub.__enter__())
        mp.setenv("HF_TOKEN", "hf_tracked")
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            code, rows = run_rl(TRACKED, out)
    finally:
        hub.__exit__(None, None, None)
        mp.undo()
    assert code == 0, console.getvalue()[-3000:]
    return {"dir": out, "rows": rows, "hub": hub, "console": console.getvalue().splitlines()}


def _series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as tag -> [(step, value)]: the reference every tracker must match."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and v == v:
                out.setdefault(k, []).append((r["step"], float(v)))
    return out


def _mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    from rlhf.track import default_tracking_uri

    client = MlflowClient(tracking_uri=default_tracking_uri())
    exp = client.get_experiment_by_name("rlhf")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlhf.run_dir` = '{out.resolve()}'")
    return client, run


def test_tensorboard_has_every_metric_at_mlflows_steps(tracked_run):
    out, rows = tracked_run["dir"], tracked_run["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]  # counted from 1, as the console's "step 1/3"
    tb = tb_events.scalars(out / "tensorboard")
    ref = _series(rows)
    client, run = _mlflow_run(out)
    for key in ("reward/mean", "kl/mean", "response/length_mean", "actor/entropy", "time/generate"):
        mlflow_points = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert [s for s, _ in tb[key]] == [s for s, _ in ref[key]] == sorted(s for s, _ in mlflow_points), key
        for (_, a), (_, b) in zip(tb[key], ref[key]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), key  # event files hold float32
    assert set(ref) <= set(tb)  # every metric of the run, not only the ones checked above


def test_tensorboard_records_the_config(tracked_run):
    from rlhf.spec.build import config_dict, flatten

    text = tb_events.texts(tracked_run["dir"] / "tensorboard")
    lines = {ln.strip() for ln in text["config"].splitlines()}
    spec = make_spec(TRACKED, tracked_run["dir"])
    for k in ("algo.name", "train.steps", "algo.kl.coef", "model.path"):
        assert f"{k}: {flatten(config_dict(spec))[k]}" in lines, k
    assert text["status"] == "FINISHED" and text["final_model"].endswith("final/hf")


def test_offline_wandb_run_has_metrics_config_and_project(tracked_run):
    from rlhf.spec.build import config_dict, flatten

    out = tracked_run["dir"]
    (log,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    log = wandb_log.closed(log)
    hist = wandb_log.history(log)
    ref = _series(tracked_run["rows"])
    for key in ("reward/mean", "kl/mean", "response/length_mean", "actor/entropy"):
        got = [(h["_step"], h[key]) for h in hist if key in h]
        assert [s for s, _ in got] == [s for s, _ in ref[key]], key
        for (_, a), (_, b) in zip(got, ref[key]):
            assert a == pytest.approx(b, rel=1e-12), key  # JSON: the float64 value
    run = wandb_log.run_record(log)
    assert (run.project, run.display_name, run.job_type, run.run_group) == ("rlhf", "run", "rl", "")
    cfg = wandb_log.config(log)
    spec = make_spec(TRACKED, out)
    flat = flatten(config_dict(spec))
    for k in ("algo.name", "train.steps", "algo.kl.coef", "rollout.max_response_tokens"):
        node = cfg
        for part in k.split("."):
            node = node[part]
        assert node == flat[k], k
    assert cfg["derived"]["rollout_engine"] == "hf"
    assert (out / "wandb" / "rlhf_run_id").read_text().strip() == run.run_id


def test_mlflow_is_unchanged_beside_them(tracked_run):
    client, run = _mlflow_run(tracked_run["dir"])
    assert run.info.status == "FINISHED"
    assert run.data.params["algo.name"] == "grpo"
    assert {"spec.yaml", "config.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_the_run_ends_with_its_report_on_disk_and_in_mlflow(tracked_run):
    from PIL import Image

    out = tracked_run["dir"]
    png, page = out / "report" / "report.png", out / "report" / "report.html"
    with Image.open(png) as im:
        im.load()
        assert im.format == "PNG" and im.size[0] >= 1000
    text = page.read_text()
    for key in ("reward", "kl", "response_length", "entropy", "eval", "phase_time", "throughput"):
        assert f'id="panel-{key}"' in text, key
    assert 'id="absent-gpu_memory"' in text  # a CPU run: no GPU figures, and no plan to draw
    assert "eval/greedy/reward_mean" in text and "generate" in text
    client, run = _mlflow_run(out)
    assert {"report/report.png", "report/report.html"} <= {a.path for a in client.list_artifacts(run.info.run_id, "report")}


def test_the_run_pushed_its_final_model_to_the_hub(tracked_run):
    import hashlib

    out, hub = tracked_run["dir"], tracked_run["hub"]
    files = hub.repos[("model", "org/tracked")].files
    hf = out / "final" / "hf"
    local = {str(p.relative_to(hf)): hashlib.sha256(p.read_bytes()).hexdigest() for p in hf.rglob("*") if p.is_file()}
    assert {k: hashlib.sha256(v).hexdigest() for k, v in files.items() if k in local} == local
    assert set(files) == set(local) | {"README.md", "report.png"}  # no LoRA here: no adapter/
    assert files["report.png"] == (out / "report" / "report.png").read_bytes()
    assert [repo for repo, _ in hub.commits] == ["org/tracked"]


def test_the_console_holds_the_runs_own_lines_and_the_workers_write_files(tracked_run):
    """The quiet console of a CPU run: these lines and no others (16 before the per-worker files,
    2 of them MLflow's INFO lines; the workers' output of a CPU run is small, the GPU's is not)."""
    out = tracked_run["dir"]
    # (DeepSpeed's accelerator note is printed where a process first imports it: in this test
    # process by an earlier fixture's import, not by a run started with rlhf-run)
    lines = [ln for ln in tracked_run["console"] if "Setting accelerator to CPU" not in ln]
    starts = ["run dir:", "mlflow: run", "        view it: mlflow ui", "tensorboard:", "        view it: tensorboard",
              "wandb: offline run", "        send it: wandb sync", "starting the cluster: models load",
              "cluster up in", "step 1/3", "step 2/3", "step 3/3", "checkpoint:", "saved ", "report:",
              "pushed to the Hub:", "done in", "mlflow: run", "        view it: mlflow ui", "tensorboard:",
              "        view it: tensorboard", "wandb: offline run", "        send it: wandb sync"]
    assert len(lines) == len(starts), "\n".join(lines)
    for line, start in zip(lines, starts):
        assert line.startswith(start), (line, start)
    assert lines[8].endswith(f"worker logs: {out / 'logs'}/")
    (log,) = (out / "logs").iterdir()  # CPU hybrid: one process holds the device's roles
    assert log.name == "actor+reference+rollout_0.log" and log.read_text().startswith("# actor rank 0 · pid ")
    (wandb_files,) = glob.glob(str(out / "wandb" / "offline-run-*" / "files"))
    assert (Path(wandb_files) / "report" / "report.png").read_bytes() == (out / "report" / "report.png").read_bytes()


# ----------------------------------------------------------------------------- failures, no Ray


@pytest.fixture
def spec_dir(tmp_path):
    from rlhf.run import write_run_dir

    def make(backends: str, *more: str):
        out = tmp_path / "outputs" / "run"
        spec = make_spec(["train.steps=2", f"tracking.backend={backends}", "tracking.report=true", *more], out)
        write_run_dir(spec)
        return spec, out

    return make


def test_a_tracker_that_cannot_start_is_dropped_with_one_line(spec_dir):
    from rlhf.track import Tracker

    spec, out = spec_dir("[mlflow,tensorboard]")
    (out / "tensorboard").write_text("a file where the event folder goes")  # mkdir fails: like a bad disk
    lines: list[str] = []
    t = Tracker(spec, str(out), warn=lines.append)
    for step in range(2):
        t.log(step, {"reward/mean": float(step)})
    t.finish()
    assert len(lines) == 1 and "tensorboard could not start" in lines[0] and "training goes on" in lines[0]
    assert "\n" not in lines[0]
    assert [b.name for b in t.backends] == ["mlflow"] and "tensorboard: off" in t.where()
    hist = t.mlflow.client.get_metric_history(t.run_id, "reward/mean")
    assert [(m.step, m.value) for m in hist] == [(0, 0.0), (1, 1.0)]


def test_a_tracker_failing_mid_run_is_dropped_once_and_the_others_go_on(spec_dir):
    from rlhf.track import Tracker

    spec, out = spec_dir("[mlflow,tensorboard]")
    lines: list[str] = []
    t = Tracker(spec, str(out), warn=lines.append)
    tb = next(b for b in t.backends if b.name == "tensorboard")
    t.log(0, {"reward/mean": 0.5})
    # the disk fills: the event file's writes now go to /dev/full (each raises ENOSPC)
    records = tb.writer._py_recordio_writer
    good, records._writer = records._writer, open("/dev/full", "wb", buffering=0)
    for step in (1, 2):
        t.log(step, {"reward/mean": 0.5 + step})
    t.finish()
    assert len(lines) == 1 and "tensorboard failed to log metrics (OSError: [Errno 28] No space left" in lines[0]
    hist = t.mlflow.client.get_metric_history(t.run_id, "reward/mean")
    assert [m.step for m in hist] == [0, 1, 2]
    good.close()
    assert tb_events.scalars(out / "tensorboard")["reward/mean"] == [(0, 0.5)]  # what it wrote before


def test_wandb_online_without_credentials_is_one_line(spec_dir, tmp_path, monkeypatch):
    from rlhf.track import Tracker

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wbconf"))
    spec, out = spec_dir("[tensorboard,wandb]", "tracking.wandb.mode=online")  # (W&B reads WANDB_MODE once)
    lines: list[str] = []
    t = Tracker(spec, str(out), warn=lines.append)
    t.log(0, {"reward/mean": 1.0})
    t.finish()
    assert len(lines) == 1 and lines[0].startswith("tracking: wandb could not start (UsageError: ")
    assert tb_events.scalars(out / "tensorboard")["reward/mean"] == [(0, 1.0)]


def test_a_missing_tracker_package_stops_before_the_run(spec_dir, monkeypatch):
    import importlib.util

    from rlhf.spec.errors import UserError
    from rlhf.track import Tracker

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    spec, out = spec_dir("[mlflow,wandb]")
    with pytest.raises(UserError, match=r"the wandb package is not installed. Install it \(pip install 'rlhf\[wandb\]'\)"):
        Tracker(spec, str(out))


def test_a_sweep_job_joins_its_wandb_group(spec_dir, monkeypatch):
    """TrackerSweepHooks (one of rlhf.sweep.default_hooks) names the group; the job's run is in it."""
    from types import SimpleNamespace

    from rlhf.sweep import default_hooks
    from rlhf.track import Tracker
    from rlhf.track.sweep_group import TrackerSweepHooks

    monkeypatch.setenv("WANDB_MODE", "offline")
    hooks = next(h for h in default_hooks() if isinstance(h, TrackerSweepHooks))
    spec, out = spec_dir("wandb")
    hooks.sweep_start("/x/multirun/2026-01-01/12-00-00", [])
    hooks.job_start(SimpleNamespace(index=1), spec)
    t = Tracker(spec, str(out))
    assert not t.dropped
    t.finish()
    hooks.job_end(SimpleNamespace(index=1), None)
    (log,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    log = wandb_log.closed(log)
    run = wandb_log.run_record(log)
    assert (run.run_group, run.display_name) == ("sweep 2026-01-01/12-00-00", "12-00-00/1")


@pytest.mark.parametrize("value,ok", [("[mlflow,tensorboard]", True), ("none", True), ("[]", True),
                                      ("[mlflow,neptune]", False), ("tensorboard", True)])
def test_backend_takes_a_name_or_a_list(value, ok, tmp_path):
    from rlhf.spec.errors import SpecError
    from rlhf.spec.schema import tracking_backends

    if ok:
        spec = make_spec([f"tracking.backend={value}"], tmp_path / "r")
        assert set(tracking_backends(spec.tracking.backend)) <= {"mlflow", "tensorboard"}
    else:
        with pytest.raises(SpecError, match=r"tracking.backend=\['mlflow', 'neptune'\] is not valid"):
            make_spec([f"tracking.backend={value}"], tmp_path / "r")


def test_wandb_config_redacts_secrets_inside_lists_too():
    from rlhf.track.params import REDACTED, _redact_value

    assert _redact_value("reward.remote.urls", ["http://u:pw@h:1/x?token=abc", "http://h:2"]) == \
        [f"http://u:{REDACTED}@h:1/x?token={REDACTED}", "http://h:2"]
    assert _redact_value("reward.remote.api_key", "k") == REDACTED
    assert _redact_value("train.steps", 3) == 3


def test_a_resumed_run_continues_its_wandb_run(spec_dir):
    """The W&B run id is kept in the run dir; `rlhf-run resume=...` logs under the same id (offline:
    a second offline-run folder that `wandb sync` appends to the same run)."""
    import dataclasses

    from rlhf.track import Tracker

    spec, out = spec_dir("wandb", "tracking.wandb.mode=offline")
    first = Tracker(spec, str(out))
    first.log(0, {"reward/mean": 0.5})
    first.finish()
    again = Tracker(dataclasses.replace(spec, resume=str(out)), str(out))
    again.log(1, {"reward/mean": 0.75})
    again.finish()
    assert not first.dropped and not again.dropped
    logs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(logs) == 2
    ids = {wandb_log.run_record(wandb_log.closed(f)).run_id for f in logs}
    assert ids == {(out / "wandb" / "rlhf_run_id").read_text().strip()}
    steps = sorted([h["_step"] for h in wandb_log.history(f) if "reward/mean" in h] for f in logs)
    assert steps == [[0], [1]]  # one folder a session (names from the start time: any order)


def test_one_mlflow_store_per_project_whatever_the_output_dir(tmp_path, monkeypatch):
    """The default store is outputs/mlflow.db of the directory rlhf-run started in (recorded before
    Hydra may change into the run dir), for runs in any output_dir and for every sweep."""
    from rlhf.paths import TRACKING_DIR_ENV, record_tracking_dir, tracking_dir
    from rlhf.run import write_run_dir
    from rlhf.track import Tracker, default_tracking_uri

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.delenv(TRACKING_DIR_ENV)
    monkeypatch.chdir(project)
    record_tracking_dir()
    monkeypatch.chdir(tmp_path)  # as hydra.job.chdir would
    assert tracking_dir() == project / "outputs"
    assert default_tracking_uri() == f"sqlite:///{project / 'outputs' / 'mlflow.db'}"
    monkeypatch.setenv(TRACKING_DIR_ENV, str(tmp_path / "elsewhere"))
    record_tracking_dir()  # set already (by the user, or the tests): kept
    assert tracking_dir() == tmp_path / "elsewhere"
    runs = []
    for out in (tmp_path / "a" / "run", tmp_path / "multirun" / "b" / "0"):
        spec = make_spec(["train.steps=1", "tracking.backend=mlflow"], out)
        write_run_dir(spec)
        t = Tracker(spec, str(out))
        t.finish("FINISHED")
        runs.append((t.mlflow.uri, t.run_id))
    assert {u for u, _ in runs} == {f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"}
    assert (tmp_path / "elsewhere" / "mlflow.db").is_file() and runs[0][1] != runs[1][1]
    assert not (tmp_path / "a" / "mlflow.db").exists() and not (tmp_path / "multirun" / "b" / "mlflow.db").exists()
