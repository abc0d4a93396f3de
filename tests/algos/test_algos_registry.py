"""The registries of algorithm parts (rlhf/algos/registry.py): names, metadata, duplicates."""

from __future__ import annotations

import pytest
import torch

from rlhf.algos import compute_advantages, kl_penalty
from rlhf.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    EstimatorInfo,
    Registry,
    RegistryError,
)


def _fresh() -> Registry:
    return Registry("advantage estimator", "algo.estimator", "rlhf.algos.advantages",
                    {"gae": EstimatorInfo(needs_critic=True)}, EstimatorInfo)


def test_second_registration_under_a_name_is_an_error():
    reg = _fresh()
    reg.register("toy", grouped=True)(lambda x: x)
    with pytest.raises(RegistryError, match="'toy' is registered twice"):
        reg.register("toy")(lambda x: x)
    reg.register("gae")(lambda x: x)  # a declared built-in takes its function once
    with pytest.raises(RegistryError, match="'gae' is registered twice"):
        reg.register("gae")(lambda x: x)
    assert reg.info("toy") == EstimatorInfo(grouped=True)
    assert reg.names() == ("gae", "toy") and reg.builtin_names() == ("gae",)


def test_builtin_metadata_lives_in_the_declaration():
    with pytest.raises(RegistryError, match="declared in rlhf.algos.registry"):
        _fresh().register("gae", needs_critic=True)(lambda x: x)


def test_unknown_name_names_the_key_and_the_options():
    with pytest.raises(RegistryError, match=r"algo.estimator='ppo' is not valid. Choose one of: gae, grpo"):
        ADVANTAGE_ESTIMATORS.get("ppo")
    with pytest.raises(ValueError):  # a RegistryError is a ValueError for the math's callers
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


def test_every_builtin_has_its_function():
    for reg in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS):
        for name in reg.builtin_names():
            assert callable(reg.get(name)), (reg.kind, name)
    assert ADVANTAGE_ESTIMATORS.info("gae") == EstimatorInfo(needs_critic=True, whiten=True)
    assert [n for n in ADVANTAGE_ESTIMATORS.builtin_names() if ADVANTAGE_ESTIMATORS.info(n).grouped] == \
        ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]


def test_registered_estimator_runs_through_compute_advantages():
    @ADVANTAGE_ESTIMATORS.register("test_registry_ones")
    def ones(x):
        return x.mask.double(), None

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_advantages("test_registry_ones", mask=mask, scores=torch.ones(1))
    assert adv.tolist() == [[1.0, 1.0, 0.0]] and ret is None
