"""User code runs only from what the user names; no config reaches hydra.utils.instantiate;
services the project starts listen on 127.0.0.1; secrets never become MLflow params."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- hydra instantiate


def test_no_code_path_instantiates_config_targets():
    """Nothing in the package calls hydra's instantiate / get_class / get_method, and no shipped
    config or recipe has a ``_target_``: config values never name code that Hydra would run.
    (Hydra builds sweeper and launcher plugins from their plugin configs, the ``hydra/sweeper`` and
    ``hydra/launcher`` groups: rlhf registers one, the parallel launcher, whose target is its own
    class; rlhf/sweep.py only reads which sweeper and launcher a sweep has.)"""
    pat = re.compile(r"\binstantiate\s*\(|hydra\.utils\.(instantiate|call|get_class|get_method)|_target_")
    reads_sweeper = re.compile(r'OmegaConf\.select\((cfg|base), "hydra\.(sweeper|launcher)\._target_"'
                               r'|"_target_": "hydra_plugins\.rlhf_launcher\.parallel_launcher\.ParallelLauncher"')
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "rlhf").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line) and not reads_sweeper.search(line)]
    hits += [str(p.relative_to(ROOT)) for d in ("conf", "recipes") for p in (ROOT / d).rglob("*.yaml")
             if "_target_" in p.read_text()]
    assert hits == []


def test_a_target_key_in_the_config_is_rejected_and_never_instantiated(rlhf_cache, monkeypatch, capsys):
    import hydra.utils

    from rlhf import cli

    calls = []
    for name in ("instantiate", "call", "get_class", "get_method"):
        monkeypatch.setattr(hydra.utils, name, lambda *a, _n=name, **k: calls.append(_n))
    for argv in (["++reward._target_=os.system", "--plan"], ["+_target_=subprocess.call", "--plan"],
                 ["++model._target_=builtins.eval", "--plan"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "_target_" in err and "Traceback" not in err
    assert cli.main(["recipe=grpo_tiny", "--plan"]) == 0
    capsys.readouterr()
    assert calls == []


# ----------------------------------------------------------------------------- user code


def test_reward_file_loads_only_that_file(tmp_path):
    """``path/to/file.py:fn`` executes that file alone: no sibling module, no sys.path change."""
    from rlhf.rewards.loader import load_function

    marker = tmp_path / "sibling_ran"
    (tmp_path / "sibling.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (tmp_path / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (tmp_path / "mine.py").write_text("def reward(prompts, responses, **kw):\n    return [1.0] * len(responses)\n")
    path_before = list(sys.path)
    fn = load_function(f"{tmp_path}/mine.py:reward")
    assert fn(["p"], ["r"]) == [1.0]
    assert not marker.exists()
    assert sys.path == path_before


def test_reward_module_must_be_named_not_guessed(tmp_path, monkeypatch):
    """A module reference imports that module only; cwd files are not picked up by other names."""
    from rlhf.rewards.loader import load_function
    from rlhf.spec.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def reward(p, r, **k):\n    return [0.0] * len(r)\n")
    with pytest.raises(UserError):
        load_function("reward")  # no module named: nothing loaded
    with pytest.raises(UserError):
        load_function("rewardz:reward")
    assert "rewards" not in sys.modules or not str(getattr(sys.modules["rewards"], "__file__", "")).startswith(
        str(tmp_path))


def test_data_files_are_never_executed(tmp_path):
    """Data is parsed, never imported or unpickled: a .py or pickle file is an unknown format."""
    from rlhf.data.files import load_file
    from rlhf.spec.errors import UserError

    marker = tmp_path / "ran"
    for name in ("train.py", "train.pkl", "train.pt"):
        (tmp_path / name).write_text(f"open({str(marker)!r}, 'w').write('x')\n")
        with pytest.raises(UserError, match="unknown format"):
            load_file(str(tmp_path / name))
    assert not marker.exists()


# ----------------------------------------------------------------------------- listening addresses


def test_reward_server_binds_loopback_by_default():
    import inspect

    from rlhf.rewards import server

    s = server.RewardServer(lambda p, r, **k: [0.0] * len(r))
    try:
        assert s.httpd.server_address[0] == "127.0.0.1"
    finally:
        s.httpd.server_close()
    src = inspect.getsource(server)
    assert 'add_argument("--host", default="127.0.0.1")' in src


def test_mlflow_is_a_local_file_store_and_no_server_is_started(tmp_path):
    """The default tracking store is a sqlite file: no MLflow server (nothing listens); no code
    starts ``mlflow server``/``mlflow ui`` or binds 0.0.0.0."""
    from rlhf.track import default_tracking_uri

    assert default_tracking_uri().startswith("sqlite:///")
    for p in (ROOT / "rlhf").rglob("*.py"):
        text = p.read_text()
        assert "0.0.0.0" not in text, p
        assert not re.search(r"""["']mlflow["']\s*,\s*["'](server|ui)["']""", text), p


# ----------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("key,secret", [
    ("reward.remote.api_key", True), ("env.HF_TOKEN", True), ("db.password", True), ("x.client_secret", True),
    ("a.access_token", True), ("a.auth_header", True), ("rollout.max_prompt_tokens", False),
    ("rollout.max_response_tokens", False), ("data.pad_token_id", False), ("model.author", False),
    ("tracking.uri", False),
])
def test_secret_keys(key, secret):
    from rlhf.track.tracker import is_secret_key

    assert is_secret_key(key) is secret


def test_params_redact_secret_values_and_url_credentials(base_spec):
    from rlhf.spec.build import config_dict, flatten
    from rlhf.track.tracker import REDACTED, _params, redact

    clean = _params(base_spec)
    assert {k: v for k, v in clean.items() if v == REDACTED} == {}  # nothing of a normal run is hidden
    assert len(clean) >= len(flatten(config_dict(base_spec)))
    out = redact({"reward.remote.api_key": "sk-123", "env.hf_token": "hf_abc", "x.password": "pw",
                  "tracking.uri": "http://bob:hunter2@127.0.0.1:5000",
                  "reward.remote.urls": "['http://127.0.0.1:8000/score?token=abc&x=1']", "train.steps": "3"})
    assert out["reward.remote.api_key"] == out["env.hf_token"] == out["x.password"] == REDACTED
    assert out["tracking.uri"] == "http://bob:***@127.0.0.1:5000"
    assert "abc" not in out["reward.remote.urls"] and "x=1" in out["reward.remote.urls"]
    assert out["train.steps"] == "3"


def test_secrets_never_reach_mlflow(base_spec, tmp_path, monkeypatch):
    """A real MLflow run: a secret in the environment or in a URL is not in any param or tag."""
    from mlflow.tracking import MlflowClient

    from rlhf.track import Tracker

    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_VALUE_1")
    monkeypatch.setenv("MY_API_KEY", "SECRET_VALUE_2")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = SimpleNamespace(**{k: getattr(base_spec, k) for k in base_spec.__dataclass_fields__})
    spec.tracking = SimpleNamespace(backend="mlflow", uri=uri, experiment="sec", console="none", log_every=1)
    import rlhf.track.tracker as tr

    real = tr._params
    monkeypatch.setattr(tr, "_params", lambda s: {**real(base_spec),
                                                  **tr.redact({"reward.remote.api_key": "SECRET_VALUE_3",
                                                               "tracking.uri": "http://u:SECRET_VALUE_4@h"})})
    t = Tracker(spec, str(tmp_path / "outputs" / "run"))
    t.finish()
    run = MlflowClient(tracking_uri=uri).get_run(t.run_id)
    blob = repr(run.data.params) + repr(run.data.tags)
    assert "SECRET_VALUE" not in blob
    assert run.data.params["reward.remote.api_key"] == "***"
