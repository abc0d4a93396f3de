"""End-to-end RL runs at toy size (CPU, Ray + DeepSpeed + HF generate), one shared Ray.

Runs are module-scoped fixtures so that one run serves several tests: the GRPO hybrid run (the
defaults, as `rlhf-run` runs them) is the learning test of grpo, the baseline of the
placement/data-parallel equality tests, and the run that MLflow and the cleanup tests read back.
The other RL algorithms' learning tests are in test_rl_learning.py (a file of their own, so that
the two test workers share the runs).

The short runs (a few steps each) read only metrics.jsonl: no tracker (``tracking=none``, the same
metrics). Two of them sample through the plugin engine of tests/rl/engine_plugin.py (``logged_hf``:
the HF engine behind a wrapper that notes each call; on CPU the same samples and the same weight
transport as ``hf``), so that one run is both a placement check and the plugin engine's run in
that placement: the ZeRO-2 run (hybrid) and the disaggregated run (whose two engines share one slot,
``placement.rollout.engines_per_device=2``: the several-engines-per-device run). The data-parallel run is scored
by a reward server on localhost (``reward.remote``, serving the built-in reward: the same rewards),
so that it is the remote reward's run too.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import host_pids, leftovers, make_spec, run_rl, snapshot
from tests.rl.conftest import assert_learned

EQUAL_STEPS = 3
TOY = ["train.prompts_per_step=16", "rollout.max_response_tokens=4", "train.seed=1"]
GRPO = ["algo=grpo"]  # the defaults: what `rlhf-run` runs
SHORT = ["tracking=none"]  # the short runs: their metrics.jsonl is all the tests read
# a rollout engine added from a plugin module alone (nothing in rlhf/ names it)
PLUGIN_ENGINE = ["rollout.plugins=[tests.rl.engine_plugin]", "rollout.engine=logged_hf"]
ZERO2 = GRPO + SHORT + PLUGIN_ENGINE + ["train.steps=2", "train.zero_stage=2"]
# disaggregated on 3 CPU slots: actor 1, reference 1, and two rollout engines sharing the third
# (placement.rollout.engines_per_device=2), a process each (vs all on one slot)
DISAGGREGATED = GRPO + SHORT + PLUGIN_ENGINE + [f"train.steps={EQUAL_STEPS}", "placement=disaggregated",
                                                "hardware.devices_per_node=3", "placement.rollout.engines_per_device=2"]


@pytest.fixture(scope="module")
def grpo_hybrid(rl_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs") / "grpo_hybrid"
    before = snapshot()
    code, rows = run_rl(GRPO, out)
    return {"code": code, "rows": rows, "dir": out, "before": before}


def test_grpo_learns(grpo_hybrid):
    assert_learned("grpo", grpo_hybrid["code"], grpo_hybrid["rows"])


def test_largest_packed_micro_batch_is_logged_within_the_budget(grpo_hybrid, tmp_path):
    """perf/micro_batch_tokens_max (what bench.matrix plans again at, to test the plan's formulas
    apart from its token-budget margin): real tokens, never over train.max_tokens_per_micro_batch."""
    budget = make_spec(GRPO, tmp_path / "spec").train.max_tokens_per_micro_batch
    longest = [r["perf/micro_batch_tokens_max"] for r in grpo_hybrid["rows"]]
    assert longest and all(0 < n <= budget for n in longest), (longest, budget)
    # packing fills micro-batches: more than one sample's tokens (samples are far shorter than the budget)
    assert max(longest) > budget / 4, (longest, budget)


def test_optimizer_step_time_is_split_from_the_passes(grpo_hybrid):
    """The update's time less its optimizer steps (time/actor_optimizer_step) is what
    perf/fwd_bwd_tflops divides the same FLOPs by: the two throughputs and the step time agree."""
    for r in grpo_hybrid["rows"]:
        opt, whole, passes = r["time/actor_optimizer_step"], r["perf/update_tflops"], r["perf/fwd_bwd_tflops"]
        assert 0 < opt < r["time/update"], r
        assert passes > whole > 0, r
        # the worker's update seconds are F / whole and its passes' F / passes, so F follows from their
        # difference (the optimizer's); the update's seconds then sit inside the driver's time/update
        flops = opt / (1 / whole - 1 / passes)
        assert opt < flops / whole <= r["time/update"], (flops / whole, r)


def test_the_update_reports_the_graphs_it_compiled(grpo_hybrid):
    """perf/compiled_graphs: graphs dynamo compiled during the actor's update (a recompile costs a GPU
    step seconds). This run's layers are eager (model.compile_layers=auto on CPU): none, every step."""
    assert [r["perf/compiled_graphs"] for r in grpo_hybrid["rows"]] == [0.0] * len(grpo_hybrid["rows"])


@pytest.fixture(scope="module")
def zero2_run(rl_env, tmp_path_factory):
    """Two GRPO steps under ZeRO-2, sampled by the plugin engine. Its weight transport (the object
    store, which sets nothing up) reports a stand-in setup figure, as the GPU transport reports its
    seconds."""
    import rlhf.workers.schedule as schedule

    make_transport = schedule.make_transport

    def with_setup_figure(spec, cluster):
        transport = make_transport(spec, cluster)
        transport.setup_metrics = {"sync/setup_seconds": 0.25}
        return transport

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule, "make_transport", with_setup_figure)
        out = tmp_path_factory.mktemp("outputs") / "z2"
        code, rows = run_rl(ZERO2, out)
    return {"code": code, "rows": rows, "dir": out}


def test_grad_norm_is_the_steps_own_under_zero2(grpo_hybrid, zero2_run):
    """DeepSpeed's ZeRO optimizers compute the gradient norm while stepping: read after the step it
    is this step's (before, it was the previous one's). Same seeds as the ZeRO-0 run, whose norm is
    summed from the gradients themselves: the same figures."""
    code, rows = zero2_run["code"], zero2_run["rows"]
    assert code == 0
    for step in range(2):
        want, got = grpo_hybrid["rows"][step]["actor/grad_norm"], rows[step]["actor/grad_norm"]
        assert want > 0 and math.isclose(got, want, rel_tol=1e-3), (step, got, want)


def test_the_weight_syncs_setup_figure_is_logged_once(zero2_run):
    """The transport's one-time figures come with the first step's metrics only."""
    assert zero2_run["code"] == 0
    assert [r.get("sync/setup_seconds") for r in zero2_run["rows"]] == [0.25, None]


def _same_metrics(a: list[dict], b: list[dict], n: int) -> None:
    keys = ["reward/mean", "reward/std", "response/length_mean", "kl/mean", "actor/pg_loss",
            "actor/entropy", "actor/grad_norm", "actor/clip_frac", "advantages/abs_mean"]
    for step in range(n):
        for k in keys:
            x, y = a[step].get(k), b[step].get(k)
            assert x is not None and y is not None, (step, k)
            assert math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-5), (step, k, x, y)


@pytest.fixture(scope="module")
def disaggregated_run(rl_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs") / "disagg"
    code, rows = run_rl(DISAGGREGATED, out)
    return {"code": code, "rows": rows, "dir": out}


def test_hybrid_equals_disaggregated(grpo_hybrid, disaggregated_run):
    assert disaggregated_run["code"] == 0
    _same_metrics(grpo_hybrid["rows"], disaggregated_run["rows"], EQUAL_STEPS)


@pytest.mark.parametrize("placement", ["hybrid", "disaggregated"])
def test_plugin_engine_runs_the_rl_loop(zero2_run, disaggregated_run, placement):
    """The plugin engine (tests/rl/engine_plugin.py) ran the RL loop in both placements (one CPU
    slot: every role in one process; 3 slots: a process each, two engines sharing the rollout's
    slot); tests/rl/test_rl_engine_plugin.py checks that the spec, the plan and validation know it."""
    run, overrides = {"hybrid": (zero2_run, ZERO2), "disaggregated": (disaggregated_run, DISAGGREGATED)}[placement]
    spec = make_spec(overrides, run["dir"] / "probe")
    assert spec.rollout_engine == "logged_hf" and spec.layout.mode == placement
    n = {"hybrid": 1, "disaggregated": 2}[placement]
    assert spec.layout.engines == ((spec.layout.roles["rollout"][0],),) * n  # n engines on one slot
    steps = spec.train.steps
    assert run["code"] == 0 and len(run["rows"]) == steps
    calls = [json.loads(x) for x in (run["dir"] / "engine_calls.jsonl").read_text().splitlines()]
    generated = [c for c in calls if c["method"] == "generate"]
    # every step's prompts went through the plugin's engines, split between them, group_size samples each
    share = (spec.train.prompts_per_step // n, spec.algo.group_size)
    assert [(c["prompts"], c["n"]) for c in generated] == [share] * steps * n
    assert len({c["pid"] for c in generated}) == n  # a process per engine
    # and each got the weights after every update (the object-store transport of a kind without device weights)
    loads = [c for c in calls if c["method"] == "load_weights"]
    assert len(loads) == steps * n and len({c["pid"] for c in loads}) == n
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in run["rows"])


@pytest.fixture(scope="module")
def reward_server():
    """A reward server on localhost serving the built-in task's reward, counting the samples of each call."""
    from rlhf.rewards.builtin import keymap_reward
    from rlhf.rewards.server import RewardServer

    calls = []

    def counted(prompts, responses, **meta):
        calls.append(len(responses))
        return keymap_reward(prompts, responses, **meta)

    srv = RewardServer(counted).start()
    srv.calls = calls
    yield srv
    srv.close()


def _dp2(url: str) -> list[str]:
    """Hybrid on 2 slots: actor ×2 (DP), reference ×2, rollout engines ×2; same global batch. Scored by
    the reward server (weight 1; ``reward.remote``) and by the same function run locally with weight
    0, so the rewards are the defaults' and each step's remote part must equal the local part."""
    return GRPO + SHORT + [f"train.steps={EQUAL_STEPS}", "hardware.devices_per_node=2",
                           "reward=remote", f"reward.remote.urls=[{url}]", "reward.remote.batch_size=24",
                           "reward.remote.concurrency=2",
                           "reward.functions=[{fn: 'rlhf.rewards.builtin:keymap_reward', weight: 0.0, name: local}]"]


@pytest.fixture(scope="module")
def dp2_run(rl_env, reward_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs") / "dp2"
    code, rows = run_rl(_dp2(reward_server.url), out)
    return {"code": code, "rows": rows, "dir": out}


def test_one_equals_two_data_parallel_ranks(grpo_hybrid, dp2_run, reward_server):
    spec = make_spec(_dp2(reward_server.url), dp2_run["dir"] / "probe")
    assert spec.batch.train_world_size == 2
    assert dp2_run["code"] == 0
    _same_metrics(grpo_hybrid["rows"], dp2_run["rows"], EQUAL_STEPS)


def test_run_with_remote_reward(dp2_run, reward_server):
    """A run scored by a reward server on localhost (tests/rl/test_rl_remote_reward.py checks a
    server that does not answer): every sample went to the server, in batches of at most
    ``reward.remote.batch_size``, and the service's part equals the same function's run locally."""
    rows = dp2_run["rows"]
    spec = make_spec(_dp2(reward_server.url), dp2_run["dir"] / "probe")
    assert dp2_run["code"] == 0
    assert len(rows) == EQUAL_STEPS
    samples = EQUAL_STEPS * spec.train.prompts_per_step * spec.algo.group_size
    assert sum(reward_server.calls) >= samples // spec.algo.group_size  # the samples went to the server, in batches
    assert max(reward_server.calls) <= 24
    for r in rows:
        assert r["reward/remote/mean"] == pytest.approx(r["reward/local/mean"], abs=1e-6)
        assert r["reward/mean"] == pytest.approx(r["reward/remote/mean"], abs=1e-6)
    assert any(r["reward/remote/mean"] > 0 for r in rows)


def test_no_leftovers_after_run(grpo_hybrid):
    actors, pgs = leftovers(*grpo_hybrid["before"])
    assert actors == [] and pgs == []


def test_no_leftovers_after_failing_run(rl_env, tmp_path, capsys):
    bad = tmp_path / "bad_reward.py"
    # fine on its first call (the stand-in samples of the preflight), then raising inside the run
    bad.write_text("calls = []\n\ndef reward(prompts, responses, **kw):\n    calls.append(1)\n"
                   "    if len(calls) > 1:\n        raise ValueError('boom')\n    return [0.0] * len(responses)\n")
    before = snapshot()
    code, rows = run_rl(TOY + SHORT + ["algo=dr_grpo", "train.steps=2", f"reward.functions=[{{fn: '{bad}:reward'}}]"],
                        tmp_path / "fail")
    assert code == 2
    err = capsys.readouterr().err
    assert "bad_reward.py:reward raised ValueError: boom" in err
    actors, pgs = leftovers(*before)
    assert actors == [] and pgs == []
    # its host was killed, not kept for the next run (rlhf.launch.pool): no idle host is its process
    import ray

    from rlhf.launch import pool

    (pid,) = host_pids(tmp_path / "fail").values()
    assert pid not in ray.get([h.idle.remote() for h in pool.idle_hosts()])


def test_mlflow_run_read_back(grpo_hybrid):
    import mlflow
    from mlflow.tracking import MlflowClient

    from rlhf.spec.build import config_dict, flatten
    from rlhf.track import default_tracking_uri

    out = grpo_hybrid["dir"]
    client = MlflowClient(tracking_uri=default_tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id],
                              filter_string=f"tags.`rlhf.run_dir` = '{out.resolve()}'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    spec = make_spec(GRPO, out)
    for k, v in flatten(config_dict(spec)).items():
        if k == "output_dir":
            continue
        assert run.data.params[k] == str(v)[:6000], k
    series = ["reward/mean", "reward/std", "reward/min", "reward/max", "reward/keymap_reward/mean",
              "response/length_mean", "response/length_max", "response/truncation_rate", "kl/mean",
              "actor/entropy", "actor/clip_frac", "actor/approx_kl", "actor/grad_norm", "actor/lr",
              "actor/pg_loss", "time/generate", "time/reward", "time/reference", "time/update", "time/sync",
              "time/step", "throughput/tokens_per_s"]
    for key in series:
        hist = client.get_metric_history(run.info.run_id, key)
        assert len(hist) == len(grpo_hybrid["rows"]), key
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.yaml", "config.yaml"} <= arts
    # tests.helpers.make_spec turns the end-of-run report off (tracking.report=false): none drawn or logged
    assert "report" not in arts and not (out / "report").exists()
