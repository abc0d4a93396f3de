"""A rollout engine added from a plugin module alone (tests/rl/engine_plugin.py, named in
``rollout.plugins``; nothing in rlhf/ edited) runs the RL loop end to end in both placements,
and the spec, the plan and validation know it by its kind."""

from __future__ import annotations

import json

import pytest

from tests.helpers import make_spec, planned_spec, run_rl

STEPS = 3
PLUGIN = ["rollout.plugins=[tests.rl.engine_plugin]", "rollout.engine=logged_hf", f"train.steps={STEPS}",
          "train.prompts_per_step=4", "rollout.max_response_tokens=4"]


def _calls(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "engine_calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("placement", [["placement=hybrid"],  # one CPU slot: every role in one process
                                       # 3 slots: actor 1, reference 1, rollout 1, a process each
                                       ["placement=disaggregated", "hardware.devices_per_node=3"]])
def test_plugin_engine_runs_the_rl_loop(rl_env, tmp_path, placement):
    code, rows = run_rl(PLUGIN + placement, tmp_path)
    assert code == 0 and len(rows) == STEPS
    calls = _calls(tmp_path)
    generated = [c for c in calls if c["method"] == "generate"]
    # one engine on CPU: every step's 4 prompts went through the plugin's engine, group_size samples each
    group = planned_spec(PLUGIN).algo.group_size
    assert [(c["prompts"], c["n"]) for c in generated] == [(4, group)] * STEPS
    # and it got the weights after every update (the object-store transport of a kind without device weights)
    assert sum(c["method"] == "load_weights" for c in calls) == STEPS
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)


def test_spec_and_plan_know_the_plugin_engine(tmp_path):
    from rlhf.spec.errors import SpecError
    from rlhf.plan.render import render_plan

    spec = planned_spec(PLUGIN)
    assert spec.rollout_engine == "logged_hf" and spec.rollout.seeded is True  # its kind's default (HF's)
    assert "rollout: logged_hf" in render_plan(spec)
    with pytest.raises(SpecError, match=r"rollout.engine='nope' is not valid. Choose one of: auto, hf, vllm, logged_hf"):
        make_spec(PLUGIN + ["rollout.engine=nope"], tmp_path)
    with pytest.raises(SpecError, match="rollout.seeded=false: the logged_hf engine draws every sample"):
        make_spec(PLUGIN + ["rollout.seeded=false"], tmp_path)
    with pytest.raises(SpecError, match=r"rollout.plugins: cannot import 'tests.rl.no_such' \(ModuleNotFound"):
        make_spec(PLUGIN + ["rollout.plugins=[tests.rl.no_such]"], tmp_path)
