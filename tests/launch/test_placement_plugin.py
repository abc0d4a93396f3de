"""A placement added from a plugin module alone (tests/launch/placement_plugin.py, named in
``placement.plugins``; nothing in rlhf/ edited): the build lays it out, the plan prints it with a
memory figure for the devices the actor and the reference share, the launcher reserves one
placement group for the two, and the RL loop runs on CPU."""

from __future__ import annotations

import pytest

from tests.helpers import make_spec, planned_spec, run_rl

PLUGIN = ["placement.plugins=[tests.launch.placement_plugin]", "placement.mode=actor_with_reference"]


def test_layout_and_launcher_slots():
    from rlhf.launch.cluster import group_devices, placement

    spec = planned_spec(PLUGIN + ["hardware.devices_per_node=2"])
    lay = spec.layout
    assert lay.pools == (("actor", "reference"), ("rollout",))
    assert lay.roles == {"actor": (0,), "reference": (0,), "rollout": (1,)} and lay.engines == ((1,),)
    assert lay.shares("actor", "reference") and not lay.rollout_beside_training
    assert group_devices(spec) == {"actor+reference": (0,), "rollout": (1,)}
    slots = placement(spec)
    # the two roles of device 0 take half of it each, in the one placement group of their pool
    assert [(s.group, s.bundles, s.resources) for s in slots["actor"]] == [("actor+reference", (0,), {"CPU": 0.5})]
    assert [(s.group, s.bundles, s.resources) for s in slots["reference"]] == [("actor+reference", (0,), {"CPU": 0.5})]
    assert [(s.group, s.resources) for s in slots["rollout"]] == [("rollout", {"CPU": 1.0})]


def test_gpu_plan_has_a_figure_for_the_shared_devices():
    from rlhf.plan.memory import estimate
    from rlhf.plan.render import render_plan

    spec = planned_spec(PLUGIN + ["model=qwen2.5-0.5b", "hardware=8xh100"])
    est = estimate(spec)
    assert set(est.figures) == {"actor + reference", "rollout"}
    shared = est.figures["actor + reference"]
    # the reference's weights and pass sit beside the actor's states, one runtime for the device
    assert {"actor weights", "reference weights", "reference pass", "runtime"} <= set(shared)
    assert shared["runtime"] == est.figures["rollout"]["runtime"]  # counted once, not per role
    text = render_plan(spec)
    assert "placement (actor_with_reference, 8 devices):" in text
    assert f"device {_range(spec.layout.roles['actor'])}: actor, reference" in text
    assert "actor + reference:" in text


def _range(devs):
    from rlhf.plan.render import ranges

    return ranges(devs)


def test_validation_knows_the_plugin(tmp_path):
    from rlhf.spec.errors import SpecError

    with pytest.raises(SpecError, match=r"placement.mode='nope' is not valid. Choose one of: hybrid, disaggregated, "
                                        r"actor_with_reference"):
        make_spec(PLUGIN[:1] + ["placement.mode=nope"], tmp_path)
    with pytest.raises(SpecError, match=r"placement=actor_with_reference needs 4 devices \(actor \+ reference 3, "
                                        r"rollout 1\) but hardware=cpu has 2"):
        make_spec(PLUGIN + ["hardware.devices_per_node=2", "placement.actor=3"], tmp_path)


def test_plugin_placement_runs_the_rl_loop(rl_env, tmp_path):
    code, rows = run_rl(PLUGIN + ["hardware.devices_per_node=2", "train.steps=3", "train.prompts_per_step=4",
                                  "rollout.max_response_tokens=4"], tmp_path)
    assert code == 0 and len(rows) == 3
    assert all("kl/mean" in r for r in rows)  # the reference (beside the actor) gave its log-probs each step
