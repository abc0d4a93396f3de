"""The spec: typed once, validated with every problem at once, derived once, frozen."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from rlhf import cli
from rlhf.spec.build import (
    FrozenDict,
    build,
    build_sections,
    config_dict,
    plan_batch,
    to_dict,
    typed_config,
)
from rlhf.spec.errors import SpecError
from rlhf.placement.layout import disaggregated_counts
from rlhf.spec import schema as S


@pytest.fixture(scope="module")
def llama_cfg():
    return cli.compose(["algo=ppo", "model=llama3-8b", "hardware=8xh100"])


@pytest.fixture(scope="module")
def llama_spec(llama_cfg):
    return build(llama_cfg)


def test_spec_is_frozen_all_the_way_down(llama_spec):
    with pytest.raises(AttributeError, match="frozen"):
        llama_spec.train.steps = 3
    with pytest.raises(AttributeError, match="frozen"):
        llama_spec.algo.kl.coef = 0.5
    with pytest.raises(AttributeError, match="frozen"):
        llama_spec.batch = None
    with pytest.raises(TypeError, match="frozen"):
        llama_spec.layout.roles["actor"] = (0,)
    assert isinstance(llama_spec.data.train_files, tuple)
    assert isinstance(llama_spec.layout.roles, FrozenDict)


def test_spec_pickles_for_ray_and_stays_frozen(llama_spec):
    back = pickle.loads(pickle.dumps(llama_spec))
    assert to_dict(back) == to_dict(llama_spec)
    with pytest.raises(AttributeError):
        back.train.steps = 1
    with pytest.raises(TypeError):
        back.layout.roles["x"] = ()


def test_config_dict_rebuilds_the_same_spec_without_hydra(llama_spec):
    again = build(config_dict(llama_spec))
    assert to_dict(again) == to_dict(llama_spec)


def test_typed_fast_path_equals_merge_onto_schemas(llama_cfg):
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(llama_cfg, resolve=False)
    plain.pop("hydra")
    fast, slow = typed_config(llama_cfg), typed_config(plain)
    assert {k: to_dict(v) for k, v in fast.items()} == {k: to_dict(v) for k, v in slow.items()}


def test_derived_values_are_computed_once_and_consistent(llama_spec):
    b = llama_spec.batch
    assert llama_spec.roles == ("actor", "critic", "reference", "rollout")
    assert b.samples_per_step == b.prompts_per_step * b.group_size == 128 * 8
    assert b.train_world_size == 8
    assert b.micro_batch_size * b.grad_accum * b.train_world_size == b.mini_batch_size
    assert llama_spec.rollout_engine == "vllm"
    assert len(llama_spec.layout.engines) == 8


def test_validation_reports_every_problem_at_once():
    secs = typed_config(cli.compose([]))
    secs["algo"].kl.estimator = "k9"
    secs["algo"].lr = -1.0
    secs["train"].steps = 0
    secs["tracking"].backend = "neptune"
    secs["rollout"].temperature = 0.0
    with pytest.raises(SpecError) as e:
        build_sections(secs)
    text = "\n".join(e.value.problems)
    for bit in ("algo.kl.estimator='k9'", "algo.lr=-1.0", "train.steps=0", "tracking.backend='neptune'",
                "rollout.temperature=0.0"):
        assert bit in text
    assert len(e.value.problems) == 5
    assert e.value.render().count("error: ") == 5


def test_batch_math_suggestions_are_valid_settings():
    base = typed_config(cli.compose(["algo=ppo", "algo.group_size=1", "model=llama3-8b", "hardware=8xh100"]))
    secs = copy.deepcopy(base)
    secs["train"].prompts_per_step = 12
    with pytest.raises(SpecError, match=r"Use train.prompts_per_step=8 \(or 16\)"):
        build_sections(secs)
    for fixed in (8, 16):  # both suggestions build
        secs = copy.deepcopy(base)
        secs["train"].prompts_per_step = fixed
        build_sections(secs)
    secs = copy.deepcopy(base)
    secs["algo"].mini_batch_size = 48
    with pytest.raises(SpecError, match=r"algo.mini_batch_size=48 does not divide .* Use algo.mini_batch_size=32 \(or 64\)"):
        build_sections(secs)


def test_plan_batch_numbers():
    algo = S.RLAlgo(name="grpo", estimator="grpo", group_size=8, mini_batch_size=256, epochs=2)
    b = plan_batch(algo, S.TrainSpec(prompts_per_step=128, micro_batch_size=8), world=8)
    assert (b.samples_per_step, b.optimizer_steps_per_step, b.micro_batch_size, b.grad_accum) == (1024, 8, 8, 4)


@pytest.mark.parametrize("roles,total,expect", [
    (("actor", "reference", "rollout"), 8, {"actor": 4, "reference": 2, "rollout": 2}),
    (("actor", "critic", "reference", "rollout"), 32, {"actor": 16, "critic": 4, "reference": 4, "rollout": 8}),
    (("actor", "rollout"), 2, {"actor": 1, "rollout": 1}),
    (("actor",), 8, {"actor": 8}),
])
def test_disaggregated_automatic_counts(roles, total, expect):
    pl = S.PlacementSpec(mode="disaggregated", rollout=S.RolloutPlacement(engines=0, tensor_parallel=1))
    assert disaggregated_counts(pl, roles, total) == expect


def test_schemas_are_registered_in_the_config_store():
    from hydra.core.config_store import ConfigStore

    cli.register_configs()
    repo = ConfigStore.instance().repo
    assert "rlhf_schema.yaml" in repo
    assert {"rl_schema.yaml", "dpo_schema.yaml", "rm_schema.yaml", "sft_schema.yaml"} <= set(repo["algo"])
    for group in ("model", "hardware", "placement", "data", "reward", "tracking"):
        assert "schema.yaml" in repo[group], group
    # the recipes are not stored there: Hydra reads them from rlhf://recipes when picked
    assert "recipe" not in repo


def test_every_algo_schema_field_has_a_default_or_is_named():
    for cls in S.ALGO_SCHEMAS.values():
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"name", "kind", "lr", "epochs"} <= names
