"""The presets by name (RL: conf/algo/dapo|gspo|cispo|sapo.yaml; preference: kto|orpo|simpo.yaml): each
composes, validates and plans
as `rlhf-run algo=<name> --plan`, sets what its comment says, and names its paper; the keys they
brought (cispo/sapo settings, DAPO's buffer fraction) are validated with one clear line each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import planned_spec

CONF = Path(__file__).resolve().parents[2] / "conf" / "algo"

# what each preset promises: the algo keys its comment documents
PRESETS = {
    "dapo": {"estimator": "grpo", "policy_loss": "clip", "group_size": 16, "clip_low": 0.2, "clip_high": 0.28,
             "dynamic_sampling": True, "loss_agg": "token_mean", "overlong_buffer_fraction": 0.2,
             "overlong_penalty": 1.0, "kl.coef": 0.0},
    "gspo": {"estimator": "grpo", "policy_loss": "clip", "ratio_level": "sequence", "clip_low": 3e-4,
             "clip_high": 4e-4, "loss_agg": "seq_mean_token_mean", "kl.coef": 0.0},
    "cispo": {"estimator": "grpo", "policy_loss": "cispo", "clip_low": 1.0, "clip_high": 0.28,
              "loss_agg": "token_mean", "kl.coef": 0.0},
    "sapo": {"estimator": "grpo", "policy_loss": "sapo", "tau_pos": 1.0, "tau_neg": 1.05,
             "loss_agg": "seq_mean_token_mean", "kl.coef": 0.0},
}
PAPERS = {"dapo": "Yu et al. 2025", "gspo": "Zheng et al. 2025", "cispo": "MiniMax-M1", "sapo": "Gao et al. 2025",
          "kto": "Ethayarajh et al. 2024", "orpo": "Hong et al. 2024", "simpo": "Meng et al. 2024"}
PREFERENCE = {
    "kto": {"loss_type": "kto", "beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0, "reference_free": False},
    "orpo": {"loss_type": "orpo", "beta": 0.1, "reference_free": True},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "gamma": 1.0, "reference_free": True},
}


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_composes_plans_and_sets_what_it_says(name, capsys):
    from rlhf import cli

    spec = planned_spec([f"algo={name}"])
    assert spec.algo.name == name and spec.algo.kind == "rl"
    for key, want in PRESETS[name].items():
        assert _get(spec.algo, key) == pytest.approx(want) if isinstance(want, float) else _get(spec.algo, key) == want, key
    assert "reference" not in spec.roles and "critic" not in spec.roles  # no KL term, no critic
    assert cli.main([f"algo={name}", "--plan"]) == 0
    assert name in capsys.readouterr().out
    assert PAPERS[name] in (CONF / f"{name}.yaml").read_text()  # documented with its paper


@pytest.mark.parametrize("name", sorted(PREFERENCE))
def test_preference_preset_composes_plans_and_sets_what_it_says(name, capsys):
    from rlhf import cli

    args = [f"algo={name}", "data.train_files=[builtin:keymap-preference/train]"]
    spec = planned_spec(args)
    assert spec.algo.name == name and spec.algo.kind == "dpo"
    for key, want in PREFERENCE[name].items():
        assert _get(spec.algo, key) == want, key
    assert ("reference" in spec.roles) == (name == "kto")  # orpo and simpo have no reference term
    assert cli.main([*args, "--plan"]) == 0
    assert f"algorithm: {name}" in capsys.readouterr().out
    assert PAPERS[name] in (CONF / f"{name}.yaml").read_text()


def test_dapo_buffer_follows_the_length_limit():
    """The fraction fits any rollout.max_response_tokens (the tiny model's 4, an LLM's 20480)."""
    from rlhf.algos.objective import overlong_buffer, shape_scores

    spec = planned_spec(["algo=dapo"])
    assert overlong_buffer(spec.algo, 4) == 1 and overlong_buffer(spec.algo, 20480) == 4096
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)
    truncated = torch.tensor([False, False, True])
    scores, m = shape_scores(spec.algo, torch.ones(3), mask, truncated, 4)
    # length 3 is outside the 1-token buffer; length 4 at the limit pays the full ramp (-1), as a cut one
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("overrides,message", [
    (["algo=cispo", "algo.ratio_level=sequence"], "algo.ratio_level=sequence applies to policy_loss=clip"),
    (["algo=sapo", "algo.dual_clip=3.0"], "policy_loss=sapo has none"),
    (["algo=sapo", "algo.tau_neg=0"], "SAPO's temperatures must be > 0"),
    (["algo=cispo", "algo.clip_low=1.5"], "must be <= 1 with policy_loss=cispo"),
    (["algo=grpo", "algo.clip_low=1.0"], "must be < 1 with policy_loss=clip"),
    (["algo=dapo", "algo.overlong_buffer=2"], "both set"),
    (["algo=dapo", "algo.overlong_buffer_fraction=1.5"], "must be in (0, 1]"),
    (["algo=simpo", "algo.reference_free=false"], "algo.loss_type=simpo has no reference term"),
    (["algo=dpo", "algo.loss_type=orpo"], "algo.loss_type=orpo has no reference term"),
    (["algo=kto", "algo.reference_free=true"], "algo.loss_type=kto measures rewards against the reference"),
    (["algo=kto", "algo.label_smoothing=0.1"], "applies to loss_type=sigmoid (cDPO) only"),
    (["algo=simpo", "algo.gamma=-1"], "SimPO's target margin"),
    (["algo=kto", "algo.undesirable_weight=0"], "both must be > 0"),
    (["algo=dpo", "algo.loss_type=nope"], "Choose one of: sigmoid, ipo, hinge, kto, orpo, simpo"),
])
def test_new_keys_are_validated(overrides, message):
    from rlhf.spec.errors import SpecError

    with pytest.raises(SpecError) as e:
        planned_spec(overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("algo,unit", [("kto", "examples"), ("dpo", "pairs"), ("orpo", "pairs"), ("sft", "examples")])
def test_the_plan_counts_a_steps_units_as_the_loop_trains_them(algo, unit):
    """KTO trains on unpaired examples (rlhf.loops.dpo.prepare), not pairs: the plan's batch line says so."""
    from rlhf.plan.render import render_plan

    spec = planned_spec([f"algo={algo}"])
    [line] = [x for x in render_plan(spec).splitlines() if x.startswith("batch: ")]
    assert line.startswith(f"batch: {spec.batch.prompts_per_step} {unit} per optimizer step "), line
