"""End to end through ``rlhf.cli.main``: a bad data file, reward function, model path or output dir
ends the run with exit code 2 and one ``error:`` line, before Ray starts (no half-started
cluster: Ray not initialised by the run, no actor or placement group left behind)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_clear


def _ray_state():
    import ray

    if not ray.is_initialized():
        return None
    from tests.helpers import snapshot

    return snapshot()


CASES = [
    ("data", lambda d: [f"data.train_files=[{d}/missing.jsonl]"], ["data file", "missing.jsonl does not exist"]),
    ("data_rows", lambda d: [f"data.train_files=[{d}/bad.jsonl]"], ["bad.jsonl, row 1: 'prompt' should be a string"]),
    ("reward", lambda d: [f"reward.functions=[{{fn: '{d}/r.py:reward'}}]"],
     ["reward function", "r.py:reward", "ModuleNotFoundError", "no_such_module_xyz"]),
    # called on stand-in samples before Ray: an exception, NaN, the wrong number of values
    ("reward_raises", lambda d: [f"reward.functions=[{{fn: '{d}/raises.py:reward'}}]"],
     ["reward function", "raises.py:reward raised ZeroDivisionError", "stand-in samples"]),
    ("reward_nan", lambda d: [f"reward.functions=[{{fn: '{d}/nan.py:reward'}}]"],
     ["nan.py:reward returned a non-finite value (nan)", "stand-in samples"]),
    ("reward_length", lambda d: [f"reward.functions=[{{fn: '{d}/short.py:reward'}}]"],
     ["short.py:reward returned 1 values for 6 responses", "stand-in samples"]),
    ("reward_timeout", lambda d: ["reward.timeout_s=1e-6"], ["took more than reward.timeout_s=1e-06 s"]),
    ("model", lambda d: [f"model.path={d}/no_model"], ["model path", "no_model' does not exist", "builtin:tiny"]),
    ("output", lambda d: [f"output_dir={d}/file/run"], ["output_dir=", "/file/run is not writable"]),
]


@pytest.mark.parametrize("name,args,parts", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_before_ray(rlhf_cache, tmp_path, capsys, name, args, parts):
    import ray

    from rlhf import cli

    (tmp_path / "bad.jsonl").write_text('{"prompt": "key k1"}\n{"prompt": 3}\n')
    (tmp_path / "r.py").write_text("import no_such_module_xyz\n")
    (tmp_path / "raises.py").write_text("def reward(prompts, responses, **kw):\n    return [1 / 0 for _ in responses]\n")
    (tmp_path / "nan.py").write_text("def reward(prompts, responses, **kw):\n    return [float('nan')] * len(responses)\n")
    (tmp_path / "short.py").write_text("def reward(prompts, responses, **kw):\n    return [1.0]\n")
    (tmp_path / "file").write_text("x")
    was_up = ray.is_initialized()
    before = _ray_state()
    argv = [f"output_dir={tmp_path}/run", "tracking.backend=none", "tracking.console=plain", "train.steps=1",
            *args(tmp_path)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert_clear(lines[0], *parts)
    assert ray.is_initialized() == was_up  # the run did not start (or stop) Ray
    assert not (tmp_path / "run").exists()  # a refused run leaves no run dir
    if before is not None:
        from tests.helpers import leftovers

        assert leftovers(*before) == ([], [])


def test_a_refused_run_leaves_no_default_run_dir(rlhf_cache, tmp_path, monkeypatch, capsys):
    """Refused in its preflight (a reward function that raises on the stand-in samples), a run in
    the default outputs/<date>/<time> leaves neither that dir nor outputs/."""
    from rlhf import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "raises.py").write_text("def reward(prompts, responses, **kw):\n    raise KeyError('answer')\n")
    code = cli.main(["tracking.backend=none", "tracking.console=plain", "train.steps=1",
                     f"reward.functions=[{{fn: '{tmp_path}/raises.py:reward'}}]"])
    assert code == 2 and "raised KeyError: 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()
