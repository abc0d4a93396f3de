"""A rollout engine added from a plugin module alone (tests/rl/engine_plugin.py, named in
``rollout.plugins``; nothing in rlhf/ edited): the spec, the plan and validation know it by its kind.
Its runs of the RL loop end to end, in both placements, are two of tests/rl/test_rl_runs.py's short
runs (``test_plugin_engine_runs_the_rl_loop``: the ZeRO-2 run in hybrid placement, the
disaggregated run), which serve the placement checks there too: a run of their own would cost a
cluster start each."""

from __future__ import annotations

import pytest

from tests.helpers import make_spec, planned_spec

PLUGIN = ["rollout.plugins=[tests.rl.engine_plugin]", "rollout.engine=logged_hf", "train.steps=3",
          "train.prompts_per_step=4", "rollout.max_response_tokens=4"]


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
