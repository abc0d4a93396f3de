"""``rlhf.config.compose`` keeps Hydra's first stage (the defaults list merged) per process and applies
``KEY=VALUE`` overrides to a copy (rlhf/config/memo.py). Each case here is checked against Hydra's
whole compose of the same command line: the same config, hydra node included, the same flags, the
same one-line error."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from rlhf.config import compose, memo, parse_overrides
from rlhf.config.composition import _compose_whole
from rlhf.paths import conf_dir
from rlhf.spec.errors import SpecError

CASES = [
    ["algo=ppo", "algo.lr=3e-6", "output_dir=/tmp/kept"],
    ["algo.lr=1e-5", "algo=ppo"],  # a value before the group it belongs to
    ["train.steps=7", "recipe=grpo_tiny_optuna"],
    ["tracking.console=plain", "algo=dpo", "mode=plan"],
    ['model.path="a b, c"', "algo=ppo", "hydra.job.chdir=true"],
    ["algo.kl.coef=0.25", "train.max_tokens_per_micro_batch=null", "rollout.temperature=${algo.lr}"],
    ["train.steps=3", "hydra.job.config.override_dirname.exclude_keys=[train.steps]", "algo.lr=2e-6"],
    ["placement=disaggregated", "hardware=cpu", "train.steps=2", "train.steps=4"],  # the last one wins
    ["algo=ppo", "model=qwen2.5-0.5b", "hardware=1xh200"],  # groups alone: the kept stage is the config
    ["hydra/launcher=parallel", "algo=grpo", "hydra.sweep.dir=/tmp/kept_sweep", "algo.group_size=4"],
]


def _whole(overrides):
    return _compose_whole(list(overrides), conf_dir().resolve(), "config")


def _flags(cfg):
    return (OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg), OmegaConf.is_struct(cfg.hydra),
            OmegaConf.is_readonly(cfg.hydra))


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c) for c in CASES])
def test_kept_compose_equals_hydras_whole_compose(overrides):
    compose(overrides)  # the first stage kept (or already kept by an earlier case)
    kept, whole = compose(overrides), _whole(overrides)
    assert OmegaConf.to_container(kept) == OmegaConf.to_container(whole)
    assert kept.hydra.overrides.task == whole.hydra.overrides.task
    assert kept.hydra.job.override_dirname == whole.hydra.job.override_dirname
    assert _flags(kept) == _flags(whole)


def test_a_second_compose_with_the_same_groups_reads_no_yaml(monkeypatch):
    compose(["algo=rloo", "train.steps=5"])
    calls = []
    monkeypatch.setattr("rlhf.config.composition._compose_whole",
                        lambda *a: calls.append(a) or _compose_whole(*a))
    cfg = compose(["train.steps=9", "algo=rloo", "output_dir=/tmp/kept2"])
    assert calls == [] and cfg.train.steps == 9 and cfg.output_dir == "/tmp/kept2"
    cfg.train.steps = 11  # the caller's copy: the kept stage is not touched
    assert compose(["algo=rloo", "train.steps=5"]).train.steps == 5


@pytest.mark.parametrize("overrides", [
    ["algo=ppo", "algo.no_such_key=1"],
    ["train.steps=many"],
    ["algo=grpo", "algo.critic.lr=1e-5"],  # a key under a null section
    ["algo=ppo", "+algo.lr=1e-6"],  # + on a key that exists
])
def test_a_bad_value_is_hydras_own_one_line(overrides):
    compose(["algo=ppo", "train.steps=3"])
    with pytest.raises(SpecError) as kept:
        compose(overrides)
    with pytest.raises(SpecError) as whole:
        _whole(overrides)
    assert kept.value.render() == whole.value.render()


def test_overrides_hydra_applies_in_order_go_to_hydra_whole(monkeypatch):
    calls = []
    monkeypatch.setattr("rlhf.config.composition._compose_whole",
                        lambda ovs, *a: calls.append(list(ovs)) or _compose_whole(ovs, *a))
    overrides = ["train.steps=3", "++train.steps=5"]  # ++ after a value: Hydra applies it second
    assert compose(overrides).train.steps == _whole(overrides).train.steps == 5
    assert calls == [overrides]


def test_an_edited_config_file_is_read_again(tmp_path):
    folder = tmp_path / "conf"
    shutil.copytree(conf_dir(), folder)

    def kept(overrides):
        return memo.compose_kept(parse_overrides(overrides), folder, "config",
                                 lambda ovs: _compose_whole(ovs, folder, "config"))

    assert kept(["algo=ppo", "train.steps=3"]).algo.lr == _compose_whole(["algo=ppo"], folder, "config").algo.lr
    tiny = folder / "model_defaults" / "tiny.yaml"  # the tiny model's algo.lr
    assert "  lr: 1.0e-3\n" in tiny.read_text()
    tiny.write_text(tiny.read_text().replace("  lr: 1.0e-3\n", "  lr: 1.25e-4\n"))
    assert kept(["algo=ppo", "train.steps=4"]).algo.lr == 1.25e-4


def test_a_users_config_folder_is_read_at_every_compose(tmp_path):
    """The key covers the shipped files only: with a folder of the user's on the search path, every
    compose is Hydra's own, so an edit there between two composes is seen."""
    mine = tmp_path / "mine" / "recipe"
    mine.mkdir(parents=True)
    (mine / "quick.yaml").write_text("# @package _global_\ntrain:\n  steps: 3\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'mine'},rlhf://recipes]"
    assert compose(["recipe=quick", "algo.lr=1e-5", searchpath]).train.steps == 3
    (mine / "quick.yaml").write_text("# @package _global_\ntrain:\n  steps: 4\n")
    assert compose(["recipe=quick", "algo.lr=2e-5", searchpath]).train.steps == 4
