"""Every algo × placement × model × hardware combination in conf/ builds, or fails for a known reason."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest
import yaml
from omegaconf import OmegaConf

from rlhf import cli
from rlhf.paths import conf_dir
from rlhf.spec.build import build_sections, typed_config
from rlhf.spec.errors import SpecError
from rlhf.plan.render import render_plan
from rlhf.spec import schema as S

from spec_combos import AXES, ISSUE_ALGOS, ISSUE_MODELS, as_dict, assemble, combinations, model_defaults, options

TWO_OR_MORE_ROLES = "ppo|grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline|dpo|dapo|gspo|cispo|sapo|kto"  # orpo, simpo: no reference, the actor alone


def _yaml(*parts: str) -> dict:
    return yaml.safe_load(conf_dir().joinpath(*parts).read_text()) or {}


def tiny_does_not_split(combo) -> bool:
    """The tiny model's step (its model_defaults' prompts × the algo's group size) over the actor's
    ranks on 4×8 GPUs: 32 in hybrid; disaggregated by the automatic rule (rollout gets 8, the actor
    the largest power of two leaving a device for each other role: 16; rm/sft have only the actor)."""
    algo, placement, model, hardware = combo
    if model not in ("tiny", "tiny-chat") or hardware != "4x8xh100":
        return False
    prompts = _yaml("model_defaults", f"{model}.yaml")["train"]["prompts_per_step"]
    samples = prompts * _yaml("algo", f"{algo}.yaml").get("group_size", 1)
    world = 32 if placement == "hybrid" or algo in ("rm", "sft") else 16
    return samples % world != 0


# (algo, placement, model, hardware) patterns — "a|b" alternatives, "*" any — or a predicate on the
# combination, and the reason the combination must fail with. Everything that matches no row must
# build and plan.
EXPECTED_FAILURES = [
    # On-policy distillation needs a teacher checkpoint, which no group gives (algo.teacher.path).
    ("opd", "*", "*", "*", "algo.estimator=distill needs a teacher"),
    # Disaggregated placement needs a device per role: on 1 device only rm and sft (actor alone) fit.
    (TWO_OR_MORE_ROLES, "disaggregated", "*", "cpu", "but hardware=cpu has 1"),
    (TWO_OR_MORE_ROLES, "disaggregated", "*", "1xh200", "but hardware=1xh200 has 1"),
    (TWO_OR_MORE_ROLES, "disaggregated", "*", "1xh100", "but hardware=1xh100 has 1"),
    # 2 devices hold actor + rollout (dr_grpo: no KL, so no reference) or actor + reference (dpo),
    # not three or four roles.
    ("grpo|rloo|reinforce_pp|reinforce_pp_baseline", "disaggregated", "*", "2xh200",
     "needs 3 devices (actor 1, reference 1, rollout 1) but hardware=2xh200 has 2"),
    ("ppo", "disaggregated", "*", "2xh200", "needs 4 devices (actor 1, critic 1, reference 1, rollout 1)"),
    # The tiny model's few samples per step may not spread over 32 GPUs' data-parallel ranks.
    (tiny_does_not_split, "do not split evenly over the actor's"),
]


def _matches(row, combo) -> bool:
    if callable(row[0]):
        return row[0](combo)
    return all(any(fnmatch.fnmatch(v, p) for p in pat.split("|")) for pat, v in zip(row[:4], combo))


def expected_failure(combo):
    for row in EXPECTED_FAILURES:
        if _matches(row, combo):
            return row
    return None


def test_groups_are_independent_so_assembly_is_exact():
    """The premise of the fast walk: each group file sets only its own package, and
    model_defaults only train/rollout/model and scalar algo keys."""
    for group in AXES:
        for opt in options(group):
            text = (conf_dir() / group / f"{opt}.yaml").read_text()
            assert "@package" not in text, f"{group}/{opt}.yaml changes its package"
    for m in options("model"):
        d = model_defaults(m)
        assert set(d) <= {"train", "rollout", "model", "algo"}, (m, set(d))
        assert all(not isinstance(v, (dict, list)) for v in (d.get("algo") or {}).values()), m
        # model_defaults applies whatever the algo: only keys that every algo kind has
        common = set.intersection(*({f.name for f in dataclasses.fields(c)} for c in S.ALGO_SCHEMAS.values()))
        assert set(d.get("algo") or {}) <= common, (
            f"model_defaults/{m}.yaml sets algo keys {set(d.get('algo') or {}) - common} that some algo kinds "
            "lack (algo=dpo/rm/sft would not compose with this model)")


@pytest.mark.parametrize("combo", [
    ("dpo", "disaggregated", "tiny", "4x8xh100"),
    ("ppo", "hybrid", "qwen2.5-7b", "8xa100-80g"),
    ("sft", "hybrid", "llama3-70b", "2xh200"),
    ("rloo", "disaggregated", "tiny", "8xh100"),
])
def test_assembled_combination_equals_hydra_composition(combo):
    composed = typed_config(cli.compose([f"{g}={v}" for g, v in zip(AXES, combo)]))
    assert as_dict(assemble(*combo)) == as_dict(composed)


def test_every_combination_builds_or_fails_for_its_reason():
    combos = combinations()
    algos, models, hw = options("algo"), options("model"), len(options("hardware"))
    new_algos, new_models = len(algos) - len(ISSUE_ALGOS), len(models) - len(ISSUE_MODELS)
    assert len(combos) == 9 * 2 * 6 * hw + new_algos * 2 * 2 * hw + 2 * 2 * new_models * hw
    used = set()
    unexpected, wrong_reason, should_fail = [], [], []
    for combo in combos:
        row = expected_failure(combo)
        try:
            spec = build_sections(assemble(*combo))
        except SpecError as e:
            if row is None:
                unexpected.append((combo, e.problems))
                continue
            if not any(row[-1] in p for p in e.problems):
                wrong_reason.append((combo, row[-1], e.problems))
            used.add(EXPECTED_FAILURES.index(row))
            continue
        if row is not None:
            should_fail.append((combo, row[-1]))
            continue
        plan = render_plan(spec)  # every buildable combination also plans
        assert plan.startswith(f"run: {spec.algo.name} · {combo[1]} · {combo[2]} · {combo[3]}")
    assert not unexpected, f"{len(unexpected)} combinations failed unexpectedly, e.g. {unexpected[:3]}"
    assert not wrong_reason, f"{len(wrong_reason)} failed for another reason, e.g. {wrong_reason[:3]}"
    assert not should_fail, f"{len(should_fail)} built but should fail, e.g. {should_fail[:3]}"
    fixed_rows = {i for i, r in enumerate(EXPECTED_FAILURES) if not callable(r[0])}
    assert fixed_rows <= used, "a row of EXPECTED_FAILURES matches nothing"


def test_group_options_are_the_issue_list():
    assert set(ISSUE_ALGOS) <= set(options("algo"))
    assert options("placement") == ["disaggregated", "hybrid"]
    assert set(ISSUE_MODELS) <= set(options("model"))
    assert options("hardware") == sorted(["cpu", "1xh100", "1xh200", "2xh200", "8xh100", "8xa100-80g", "4x8xh100"])
    for g in ("data", "reward", "tracking"):
        assert options(g), g
    assert OmegaConf.load(conf_dir() / "config.yaml").defaults
