"""Multi-node runs on a simulated two-node Ray cluster on this machine (docs/multinode.md).

One process (tests/multinode/scenario.py, module fixture) starts the cluster, node A (head,
driver) and node B, and does every run; the tests read what it recorded:

* ``--plan``'s per-node map equals where the launcher's placement groups put each rank (GPU
  layouts with TP-2 engines, reserved on fake GPUs), and no TP group spans the two nodes;
* a hardware with more nodes than the cluster has: one line with both counts, exit 2;
* GRPO disaggregated over the two nodes (actor on A, rollout on B) equals the single-node run;
* (slow) PPO hybrid: two data-parallel ranks of the actor and the critic on one node equal one
  rank on each node; a worker process killed on a live node is named with its node, at once;
* node B lost (raylet SIGKILLed) in step 3 of a hybrid run with a data-parallel rank on each
  node: one line naming node 1 and the ranks it held, exit 1, step 2's checkpoint intact,
  nothing of the run left on node A; ``resume=`` on the cluster with a new node B finishes the
  run with the single-node run's metrics at every step (2 data-parallel ranks = 1, same batch).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("scenario.py")
KEYS = ["reward/mean", "reward/std", "response/length_mean", "actor/pg_loss", "actor/entropy",
        "actor/grad_norm", "actor/clip_frac", "advantages/abs_mean"]


def _scenario(tmp_path_factory, cache: str, part: str) -> dict:
    work = tmp_path_factory.mktemp(f"multinode_{part}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", RLHF_CACHE=cache)  # the session's: builtin:tiny built once
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(SCENARIO), str(work), part], env=env, capture_output=True, text=True,
                          timeout=500, cwd=str(SCENARIO.parents[2]))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((work / "results.json").read_text())


@pytest.fixture(scope="module")
def scenario(rlhf_cache, tmp_path_factory):
    return _scenario(tmp_path_factory, rlhf_cache, "grpo")


def _spans(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


def plan_nodes(text: str) -> dict[int, dict[str, tuple[int, ...]]]:
    """The per-node map of a --plan text: node -> role -> ranks (rollout: engine indices)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+node (\d+) \(devices [\d,-]+\): (.+)$", line)
        if not m:
            continue
        held = {}
        for part in m.group(2).split(", "):
            m2 = re.match(r"(\w+) (?:ranks?|engines?) ([\d,-]+)", part)
            held["rollout" if m2.group(1) in ("vllm", "hf") else m2.group(1)] = _spans(m2.group(2))
        out[int(m.group(1))] = held
    return out


def _same_metrics(a: list[dict], b: list[dict], keys: list[str] = KEYS) -> None:
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for k in keys:
            assert math.isclose(x[k], y[k], rel_tol=1e-3, abs_tol=1e-5), (x["step"], k, x[k], y[k])


def test_plan_shows_every_node(tmp_path):
    from tests.multinode.scenario import build

    from rlhf.plan.render import render_plan

    text = render_plan(build(["hardware=4x8xh100", "model=llama3-70b", "algo=grpo",
                              "placement.rollout.tensor_parallel=4"]))
    nodes = plan_nodes(text)
    assert sorted(nodes) == [0, 1, 2, 3], text
    for k in range(4):
        assert nodes[k] == {"actor": tuple(range(8 * k, 8 * k + 8)), "reference": tuple(range(8 * k, 8 * k + 8)),
                            "rollout": (2 * k, 2 * k + 1)}, text
    assert "node 3 (devices 24-31): actor ranks 24-31, reference ranks 24-31, vllm engines 6-7 (TP 4)" in text
    single = render_plan(build(["hardware=8xh100", "model=llama3-8b", "algo=grpo"]))
    assert "nodes (" not in single  # one node: no per-node map


@pytest.mark.parametrize("name", ["hybrid_tp2", "disagg_tp2"])
def test_plan_node_map_is_what_the_launcher_reserves(scenario, name):
    from tests.multinode.scenario import GPU_HW, GPU_LAYOUTS, build

    from rlhf.plan.render import render_plan

    planned = plan_nodes(render_plan(build(GPU_HW + GPU_LAYOUTS[name])))
    reserved: dict[int, dict[str, tuple[int, ...]]] = {}
    for role, ranks in scenario["reserved"][name].items():
        for rank, nodes in enumerate(ranks):
            assert len(set(nodes)) == 1, (role, rank, nodes)  # a TP group never spans nodes
            held = reserved.setdefault("AB".index(nodes[0]), {})
            held[role] = held.get(role, ()) + (rank,)
    assert reserved == planned
    assert set(planned) == {0, 1}


def test_too_few_nodes_is_one_line_before_any_reservation(scenario):
    r = scenario["too_few_nodes"]
    assert r["code"] == 2, r["err"]
    lines = [ln for ln in r["err"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in r["err"], r["err"]
    assert "needs 4 nodes with 1 CPUs each, but the Ray cluster has 2 such nodes" in lines[0]
    assert "hardware.nodes=2" in lines[0]


def test_disaggregated_over_two_nodes_equals_single_node(scenario):
    single, disagg = scenario["single"], scenario["disagg"]
    assert single["code"] == 0 and disagg["code"] == 0, (single["err"][-3000:], disagg["err"][-3000:])
    assert scenario["joined"]  # the runs joined the cluster through ray.address
    assert disagg["placed"] == [["PolicyWorker", "A"], ["RolloutWorker", "B"]]
    assert len(single["rows"]) == 4
    _same_metrics(single["rows"], disagg["rows"])


def test_lost_node_is_named_checkpoint_kept_nothing_left(scenario):
    r = scenario["lost"]
    assert r["code"] == 1, r["err"][-3000:]
    assert r["placed"] == [["Host", "A"], ["Host", "B"]]  # a data-parallel rank on each node
    lines = [ln for ln in r["err"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in r["err"], r["err"][-3000:]
    last = Path(r["dir"]) / "checkpoints" / "step_00000002"
    assert lines[0].startswith("error: node 1 (Ray node "), lines[0]
    assert "holding actor rank 1 and hf engine 1) was lost during the " in lines[0]
    assert " of step 3. Cluster shut down." in lines[0]
    assert f"Last checkpoint: {last} (step 2)" in lines[0]
    assert len(r["rows"]) == 2
    ckpts = r["checkpoints"]  # as the failed run left them
    assert list(ckpts)[-1] == "step_00000002" and not [c for c in ckpts if c.endswith(".tmp")], ckpts
    assert {"COMPLETE", "driver.pt"} <= set(ckpts["step_00000002"]), ckpts
    assert r["nodes"] == {"A": True, "B": False}
    assert r["leftovers"] == {"actors": [], "placement_groups": []}
    assert r["head_workers"] == []  # no worker process of the run on the surviving node


def test_resume_on_the_original_shape_reproduces_the_uninterrupted_run(scenario):
    r = scenario["resumed"]
    assert r["code"] == 0, r["err"][-3000:]
    assert [row["step"] for row in r["rows"]] == [1, 2, 3, 4]
    _same_metrics(scenario["single"]["rows"], r["rows"])
    assert (Path(r["dir"]) / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


def test_a_tp_group_across_nodes_is_refused():
    from tests.multinode.scenario import GPU_HW, build

    from rlhf.spec.errors import SpecError

    with pytest.raises(SpecError, match=r"rollout engine 0 would take devices 3-4, on nodes 0 and 1 .* "
                                        r"tensor parallelism does not cross nodes"):
        build(GPU_HW + ["placement=disaggregated", "placement.actor=2", "placement.reference=1",
                        "placement.rollout.engines=2", "placement.rollout.tensor_parallel=2"])


@pytest.fixture(scope="module")
def more(rlhf_cache, tmp_path_factory):
    return _scenario(tmp_path_factory, rlhf_cache, "more")


@pytest.mark.slow  # a second simulated cluster and three more runs: ~40 s on 2 cores
def test_a_worker_dying_on_a_live_node_is_named_with_its_node(more):
    r = more["crash"]
    assert r["code"] == 1, r["err"][-3000:]
    lines = [ln for ln in r["err"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in r["err"], r["err"][-3000:]
    assert lines[0].startswith("error: the process holding the actor and rollout workers (rank 1) on node 1 died "
                               "during the "), lines[0]
    assert "Last checkpoint:" in lines[0] and "step 1)" in lines[0]
    assert r["after_kill_s"] < 25  # no wait for a node death that does not come (that wait is 30 s)


@pytest.mark.slow  # a second simulated cluster and three more runs: ~40 s on 2 cores
def test_ppo_critic_and_actor_ranks_across_nodes_equal_one_node(more):
    one, two = more["ppo_one_node"], more["ppo_two_nodes"]
    assert one["code"] == 0 and two["code"] == 0, (one["err"][-3000:], two["err"][-3000:])
    assert two["placed"] == [["Host", "A"], ["Host", "B"]]
    _same_metrics(one["rows"], two["rows"], KEYS + ["critic/value_loss", "critic/explained_variance"])
