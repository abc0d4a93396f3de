"""rlhf-run: help, plans, recipes, run directories, and rerunning a run's saved config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlhf import cli
from rlhf.spec.build import config_dict, to_dict
from rlhf.paths import conf_dir
from rlhf.spec.errors import UserError
from tests.helpers import assert_clear


def plan(capsys, *argv: str) -> str:
    assert cli.main([*argv, "--plan"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


# ----------------------------------------------------------------------------- help


def test_help_lists_every_group_and_its_options(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: rlhf-run" in out and "--plan" in out and "-m" in out and "-cp" in out
    lines = {l.split()[0]: l for l in out.splitlines() if l.startswith("  ") and l.split()}
    for group in cli.GROUPS:
        assert group in lines, group
        for option in cli.group_options(group):
            assert option in lines[group], (group, option)
    assert lines["algo"].split()[1] == "grpo,"  # the default first
    assert lines["model"].split()[1] == "tiny,"
    assert "reinforce_pp_baseline" in lines["algo"] and "4x8xh100" in lines["hardware"]
    assert "grpo_tiny" in lines["recipe"]


# ----------------------------------------------------------------------------- plans


def test_default_plan_changes_nothing(capsys):
    out = plan(capsys)
    assert out.startswith("run: grpo · hybrid · tiny · cpu")
    assert "changed from the defaults: nothing" in out
    prompts = yaml.safe_load((conf_dir() / "model_defaults" / "tiny.yaml").read_text())["train"]["prompts_per_step"]
    group = yaml.safe_load((conf_dir() / "algo" / "grpo.yaml").read_text())["group_size"]
    assert f"batch: {prompts} prompts × {group} samples = {prompts * group} samples/step" in out


def test_plan_shows_what_differs_from_the_defaults(capsys):
    out = plan(capsys, "algo=ppo", "model=llama3-8b", "hardware=8xh100", "algo.kl.coef=0.05", "train.steps=7")
    block = out.split("changed from the defaults:\n")[1].split("\nmodel:")[0]
    assert block.splitlines() == [
        "  algo=ppo (default grpo)",
        "  model=llama3-8b (default tiny)",
        "  hardware=8xh100 (default cpu)",
        "  algo.kl.coef=0.05",
        "  train.steps=7",
    ]
    assert "algo=grpo" not in plan(capsys, "algo=grpo").split("model:")[0].replace("run: grpo", "")


def test_plan_shows_batch_math_and_placement_map(capsys):
    out = plan(capsys, "algo=grpo", "placement=disaggregated", "model=llama3-8b", "hardware=8xh100")
    assert "batch: 128 prompts × 8 samples = 1024 samples/step → 1 optimizer step(s) of 1024 " \
           "(micro 8 × 32 accum × 4 ranks)" in out
    assert "  device 0-3: actor\n  device 4-5: reference\n  device 6: vllm engine 0\n  device 7: vllm engine 1" in out
    out = plan(capsys, "algo=grpo", "model=llama3-8b", "hardware=8xh100", "placement.rollout.tensor_parallel=2")
    assert "device 0-1: vllm engine 0 (TP 2)" in out and "device 6-7: vllm engine 3 (TP 2)" in out


def test_plan_warns_about_idle_gpus(capsys):
    out = plan(capsys, "algo=dpo", "placement=disaggregated", "placement.actor=2", "placement.reference=2",
               "model=llama3-8b", "hardware=8xh100")
    assert "! 4 of 8 devices hold no role (idle)" in out
    out = plan(capsys, "model=llama3-8b", "hardware=8xh100", "placement.rollout.engines=4")
    assert "! 4 devices run no rollout engine" in out


def test_plan_imports_no_torch_ray_or_deepspeed():
    code = (
        "import sys; from rlhf.cli import main; "
        "rc = main(['algo=grpo', 'model=llama3-8b', 'hardware=8xh100', '--plan']); "
        "print({'rc': rc, "
        "'heavy': [m for m in ('torch', 'ray', 'deepspeed', 'vllm', 'transformers') if m in sys.modules]})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    result = eval(out.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["heavy"] == []


# ----------------------------------------------------------------------------- recipes


def test_recipe_with_a_defaults_list_overrides_groups(capsys):
    out = plan(capsys, "recipe=ppo_llama3_8b_8xh100")
    assert out.startswith("run: ppo · hybrid · llama3-8b · 8xh100")
    assert "critic" in out and "✓ fits" in out
    assert "recipe=ppo_llama3_8b_8xh100: " in out


def test_command_line_wins_over_a_recipe(capsys):
    out = plan(capsys, "recipe=grpo_tiny", "train.steps=3", "algo=rloo")
    assert out.startswith("run: rloo · hybrid · tiny · cpu")
    assert "steps: 3 " in out
    spec = cli.build_spec(cli.compose(["recipe=grpo_tiny"]), ["recipe=grpo_tiny"], plan=True)
    assert (spec.algo.name, spec.algo.group_size, spec.train.steps, spec.tracking.backend) == ("grpo", 4, 30, "none")


# ----------------------------------------------------------------------------- running


@pytest.fixture
def fake_run(monkeypatch):
    """Stand in for rlhf.run (the training loop) and record the spec it gets."""
    import rlhf.run

    seen = []

    def run(spec, checked=False):
        seen.append(spec)
        return 0

    monkeypatch.setattr(rlhf.run, "run", run)  # what rlhf.run.execute calls
    return seen


def test_a_run_gets_a_fresh_run_dir(fake_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train.steps=2"]) == 0
    assert cli.main(["train.steps=2"]) == 0
    a, b = (Path(s.output_dir) for s in fake_run)
    assert a != b and a.is_dir() and b.is_dir()
    assert a.relative_to(tmp_path.resolve()).parts[0] == "outputs" and fake_run[0].mode == "run"
    assert cli.main(["output_dir=mine/run1"]) == 0  # relative to where rlhf-run started
    assert fake_run[-1].output_dir == str(tmp_path.resolve() / "mine/run1") and (tmp_path / "mine/run1").is_dir()


def _raised_in_a_worker(error: BaseException) -> BaseException:
    """What ray.get raises in the driver for ``error`` raised inside an actor's method."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise error
    except type(error):
        return RayTaskError("Worker.step", traceback.format_exc(), error).as_instanceof_cause()


class _Wrapper(Exception):  # an error that carries a worker's as .cause but is no UserError itself
    def __init__(self, cause):
        super().__init__("worker died\nTraceback ...")
        self.cause = cause


def _carrying_another(error):  # a UserError that carries an error of another kind as .cause
    outer = UserError(str(error))
    outer.cause = OSError("inner")
    return outer


@pytest.mark.parametrize("wrap", [None, _raised_in_a_worker, _Wrapper, _carrying_another],
                         ids=["driver", "ray_task_error", "cause", "user_error_with_cause"])
def test_a_user_error_at_run_time_exits_2(wrap, tmp_path, monkeypatch, capsys):
    """rlhf.run.run, stopped before the cluster starts by a UserError from the driver or from a
    worker (Ray's wrapper, whose text is a traceback): exit 2 and the error's own line."""
    import rlhf.preflight

    def fail(spec, console=None):
        error = UserError("data file missing: x.jsonl")
        raise error if wrap is None else wrap(error)

    monkeypatch.setattr(rlhf.preflight, "resolve_models", fail)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tracking.backend=none", "tracking.console=plain"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["error: data file missing: x.jsonl"], lines


def test_a_run_dir_that_cannot_be_made_is_one_line(fake_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    assert cli.main([f"hydra.run.dir={tmp_path}/file/run"]) == 2
    err = capsys.readouterr().err
    assert_clear(err, f"{tmp_path}/file/run", "is not writable", "output_dir=<path>")
    assert err.startswith("error: ") and fake_run == []


@pytest.mark.parametrize("writer", ["omegaconf", "yaml"])
def test_rerun_from_a_run_dir_rebuilds_the_same_spec(writer, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["recipe=ppo_llama3_8b_8xh100", "algo.kl.coef=0.02", "train.steps=7", "data.train_files=[a.jsonl,b.jsonl]",
            "data.weights=[0.25,0.75]", "+reward.functions=[{fn: m:f, weight: 0.5}]", "output_dir=outputs/first"]
    first = cli.build_spec(cli.compose(argv), argv, plan=False)
    run_dir = tmp_path / "outputs" / "first"
    run_dir.mkdir(parents=True)
    saved = config_dict(first)  # what the run writes as config.yaml
    if writer == "omegaconf":
        OmegaConf.save(OmegaConf.create(saved), run_dir / "config.yaml")
    else:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))

    again = cli.build_spec(cli.compose([], config_dir=str(run_dir)), [], plan=False, config_dir=str(run_dir))
    a, b = to_dict(first), to_dict(again)
    assert b["output_dir"] != a["output_dir"]  # a new run dir of its own ...
    for k in ("output_dir", "overrides", "changes"):
        a.pop(k), b.pop(k)
    assert a == b  # ... and otherwise the same spec, derived values included

    assert cli.main(["-cp", str(run_dir), "-cn", "config", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run: ppo · hybrid · llama3-8b · 8xh100")
    assert cli.main(["-cp", str(run_dir), "-cn", "config", "train.steps=9", "--plan"]) == 0
    assert "steps: 9 " in capsys.readouterr().out
    assert cli.main(["-cp", str(run_dir), "-cn", "config", "train.stepz=9", "--plan"]) == 2
    assert "train.stepz is not a config key" in capsys.readouterr().err


def test_rerun_from_what_the_run_writes(tmp_path, monkeypatch, capsys):
    """rlhf.run.write_run_dir writes spec.yaml and config.yaml; -cp <run dir> -cn config rebuilds the spec."""
    run_module = pytest.importorskip("rlhf.run")
    monkeypatch.chdir(tmp_path)
    argv = ["algo=rloo", "train.steps=5", "algo.kl.coef=0.02", "output_dir=outputs/r1"]
    first = cli.build_spec(cli.compose(argv), argv, plan=False)
    run_dir = run_module.write_run_dir(first)
    again = cli.build_spec(cli.compose([], config_dir=str(run_dir)), [], plan=False, config_dir=str(run_dir))
    a, b = to_dict(first), to_dict(again)
    cwd = str(tmp_path.resolve())
    assert a["output_dir"] == f"{cwd}/outputs/r1" and b["output_dir"].startswith(f"{cwd}/outputs/")
    for k in ("output_dir", "overrides", "changes"):
        a.pop(k), b.pop(k)
    assert a == b
    saved_spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    assert saved_spec["batch"] == to_dict(again)["batch"] and saved_spec["layout"] == to_dict(again)["layout"]


def test_spec_yaml_of_a_run_is_plain_data(tmp_path):
    spec = cli.build_spec(cli.compose(["algo=dpo"]), ["algo=dpo"], plan=True)
    text = json.dumps(to_dict(spec))  # everything is plain data (YAML/MLflow friendly)
    assert '"kind": "dpo"' in text


# ----------------------------------------------------------------------------- the README stays true

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_group_table_matches_conf():
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].strip("`")] = [o.strip() for o in cells[1].split(",")]
    for group in cli.GROUPS:
        listed = [o for o in rows[group] if o != "(none)"]
        if group in ("data", "reward", "tracking", "recipe"):  # these grow: the README names some, none that do not exist
            assert listed and set(listed) <= set(cli.group_options(group)), group
            continue
        assert sorted(listed) == cli.group_options(group), group
        default = cli.default_choices()[group]
        if default:
            assert listed[0] == default, group


def test_readme_plan_commands_work(capsys):
    commands = [l.split("#")[0].strip() for l in README.read_text().splitlines()
                if l.startswith("rlhf-run ") and "--plan" in l and " -m " not in l]
    assert len(commands) >= 4
    for command in commands:
        argv = [a for a in command.split()[1:]]
        assert cli.main(argv) == 0, command
        capsys.readouterr()


@pytest.mark.parametrize("recipe", cli.group_options("recipe"))
def test_every_recipe_plans(recipe, capsys):
    out = plan(capsys, f"recipe={recipe}")
    assert out.startswith("run: ") and f"recipe={recipe}" in out
