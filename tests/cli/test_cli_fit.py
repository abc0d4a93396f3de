"""A GPU run whose plan does not fit stops before anything starts: one line, exit 2, no run dir."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_non_fitting_gpu_plan_stops_before_the_run_dir(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "rlhf.cli", "model=qwen2.5-7b", "hardware=1xh200",
                        "train.offload_optimizer=false", f"model.path={tmp_path}", f"output_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: does not fit: the training phase needs"), r.stderr
    assert "Try " in lines[0]
    assert not out.exists()


def test_a_refused_run_gives_its_claimed_run_dir_back(tmp_path, monkeypatch, capsys):
    from rlhf import cli

    cwd = tmp_path / "cwd"
    (cwd / "outputs").mkdir(parents=True)  # there before: kept
    monkeypatch.chdir(cwd)
    argv = ["model=qwen2.5-7b", "hardware=1xh200", "train.offload_optimizer=false", f"model.path={tmp_path}"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: does not fit")
    assert [p.name for p in cwd.iterdir()] == ["outputs"] and not any((cwd / "outputs").iterdir())


def test_a_run_checks_its_fit_disk_and_output_dir_once(tmp_path, monkeypatch, capsys):
    """execute → check_before_run → run → resolve_models → preflight: each check once (a sweep job
    goes the same way); the stand-in model check stops the run before any model loads."""
    from rlhf import preflight, run
    from rlhf.spec.errors import UserError
    from tests.helpers import make_spec

    calls = []
    for name in ("check_fits", "check_disk", "check_output_dir"):
        real = getattr(preflight, name)
        monkeypatch.setattr(preflight, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setattr(preflight, "resolve_models", lambda spec, console=None: spec)

    def stop(*a, **k):
        raise UserError("stop here")

    monkeypatch.setattr(preflight, "check_model", stop)
    spec = make_spec(["model=qwen2.5-0.5b", "hardware=8xh100", "tracking.backend=none"], tmp_path / "run")
    assert run.execute(spec) == 2 and "error: stop here" in capsys.readouterr().err
    assert sorted(calls) == ["check_disk", "check_fits", "check_output_dir"]
