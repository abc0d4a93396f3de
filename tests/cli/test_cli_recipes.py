"""A user's own folder of recipes and group options, outside the package (``-cd DIR``,
``hydra.searchpath=[file://DIR]``, $RLHF_CONFIG_DIRS), and config files that are not valid YAML:
each fails alone, with one line naming file, line and column, only when it is used."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from rlhf import cli, paths

# A recipe of a shipped name (grpo_tiny) that picks an algo option of the user's own (algo/mine.yaml).
RECIPE = """\
# @package _global_
defaults:
  - override /algo: mine
train:
  steps: 3
tracking:
  backend: none
"""
ALGO = """\
defaults:
  - rloo
  - _self_
kl:
  coef: 0.03
"""


@pytest.fixture
def user_dir(tmp_path):
    folder = tmp_path / "my_experiments"
    (folder / "recipe").mkdir(parents=True)
    (folder / "algo").mkdir()
    (folder / "recipe" / "grpo_tiny.yaml").write_text(RECIPE)
    (folder / "algo" / "mine.yaml").write_text(ALGO)
    return folder


@pytest.fixture
def recording_run(monkeypatch):
    """rlhf.run.run that only writes the run dir (spec.yaml, config.yaml): the run goes through the
    Hydra app with the user's search path, and no Ray starts."""
    import rlhf.run

    seen = []

    def run(spec, checked=False):
        seen.append(spec)
        rlhf.run.write_run_dir(spec)
        return 0

    monkeypatch.setattr(rlhf.run, "run", run)
    return seen


def _saved(spec) -> dict:
    return yaml.safe_load((Path(spec.output_dir) / "config.yaml").read_text())


@pytest.mark.parametrize("how", ["-cd", "--config-dir=", "hydra.searchpath", "env"])
def test_a_recipe_outside_the_package_replaces_the_shipped_one(how, user_dir, recording_run, tmp_path,
                                                                monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    where = {"-cd": ["-cd", "my_experiments"], "--config-dir=": [f"--config-dir={user_dir}"],
             "hydra.searchpath": [f"hydra.searchpath=[file://{user_dir}]"], "env": []}[how]
    if how == "env":
        monkeypatch.setenv("RLHF_CONFIG_DIRS", str(user_dir))
    assert cli.main([*where, "recipe=grpo_tiny", "--plan"]) == 0
    plan = capsys.readouterr().out
    assert "algo=mine (default grpo)" in plan and "recipe=grpo_tiny: train.steps=3 tracking.backend=none" in plan
    assert cli.main([*where, "recipe=grpo_tiny", "output_dir=runs/x"]) == 0
    saved = _saved(recording_run[-1])
    # the user's recipe, not the shipped one (which sets algo.group_size=4, train.steps=30)
    assert saved["train"]["steps"] == 3 and saved["algo"]["name"] == "rloo" and saved["algo"]["kl"]["coef"] == 0.03
    assert saved["algo"]["group_size"] != 4
    # the shipped recipes stay there beside the user's folder
    assert cli.main([*where, "recipe=dpo_tiny", "--plan"]) == 0
    assert "run: dpo" in capsys.readouterr().out


def test_the_shipped_recipe_without_the_user_folder(recording_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["recipe=grpo_tiny", "output_dir=runs/y", "tracking.backend=none"]) == 0
    saved = _saved(recording_run[-1])
    assert saved["train"]["steps"] == 30 and saved["algo"]["group_size"] == 4


def test_user_folder_problems_are_one_line(user_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-cd", "nowhere", "--plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "-cd nowhere: no such folder" in err
    assert cli.main(["-cd", str(user_dir), "recipe=nonesuch", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'nonesuch' not found" in err and "grpo_tiny" in err and "dpo_tiny" in err
    assert cli.main(["-cd", str(user_dir), "--describe", "algo.kl.coef", "algo=mine"]) == 0
    assert "0.03" in capsys.readouterr().out


def _one_line(err: str, path: Path, line: int, column: int) -> None:
    assert err.strip().count("\n") == 0, err
    assert f"{path}:{line}:{column}: not valid YAML" in err, err


def test_a_broken_user_file_fails_alone_and_only_when_used(user_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = user_dir / "recipe" / "bad.yaml"
    bad.write_text("# @package _global_\ntrain:\n  steps: 3\n   lr: 2\n")  # line 4: a wrong indent
    broken_algo = user_dir / "algo" / "broken.yaml"
    broken_algo.write_text("defaults:\n  - grpo\nlr: [1e-3\n")
    (user_dir / "recipe" / "uses_broken.yaml").write_text("# @package _global_\ndefaults:\n  - override /algo: broken\n")
    # a plan that names none of them works
    assert cli.main(["-cd", str(user_dir), "--plan"]) == 0
    capsys.readouterr()
    assert cli.main(["-cd", str(user_dir), "recipe=bad", "--plan"]) == 2
    err = capsys.readouterr().err
    _one_line(err, bad, 4, 6)
    assert err.startswith("error: recipe=bad: ")
    assert cli.main(["-cd", str(user_dir), "algo=broken", "--plan"]) == 2
    _one_line(capsys.readouterr().err, broken_algo, 4, 1)
    # named by a recipe's defaults list: Hydra's own load, the same one line
    assert cli.main(["-cd", str(user_dir), "recipe=uses_broken", "--plan"]) == 2
    _one_line(capsys.readouterr().err, broken_algo, 4, 1)
    # --help lists them as broken, with the line
    assert cli.main(["-cd", str(user_dir), "--help"]) == 0
    out = capsys.readouterr().out
    assert "bad [broken]" in out and "broken [broken]" in out and "mine," in out
    assert f"recipe=bad: {bad}:4:6" in out


def test_a_broken_shipped_recipe_breaks_nothing_else(tmp_path, monkeypatch, capsys):
    shipped = tmp_path / "recipes"
    shutil.copytree(paths.recipes_dir(), shipped)
    (shipped / "zz_broken.yaml").write_text("# @package _global_\ntrain: {steps: 3\n")
    monkeypatch.setattr(paths, "recipes_dir", lambda: shipped)
    monkeypatch.chdir(tmp_path)
    for argv in (["--plan"], ["recipe=grpo_tiny", "--plan"], ["--describe", "train.steps"]):
        assert cli.main(argv) == 0, argv
    capsys.readouterr()
    assert cli.main(["recipe=zz_broken", "--plan"]) == 2
    _one_line(capsys.readouterr().err, shipped / "zz_broken.yaml", 3, 1)
    assert cli.main(["-m", "recipe=grpo_tiny,zz_broken", "--plan"]) == 2
    _one_line(capsys.readouterr().err, shipped / "zz_broken.yaml", 3, 1)
    assert cli.main(["--help"]) == 0
    assert "zz_broken [broken]" in capsys.readouterr().out


@pytest.mark.parametrize("override,problem", [
    ("algo.lr='x", "unexpected \"'\" at column 9"),
    ("a b=1", "unexpected ' ' at column 2"),
    ("algo.lr=[1", "no viable alternative at input '[1'"),
])
def test_an_override_that_does_not_parse_names_the_problem(override, problem, capsys):
    assert cli.main([override, "--plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"({problem})" in err and "https://" not in err and "at at" not in err, err


def test_a_recipe_plans_from_outside_the_checkout(tmp_path):
    """`rlhf-run recipe=... --plan` started in another directory: Hydra's plugin scan misses the
    recipes' config source of an editable install, so rlhf.config registers it itself."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "from rlhf.cli import entrypoint; entrypoint()", "recipe=grpo_tiny",
                          "--plan"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("run: grpo"), out.stdout[:500]
