"""RL evaluation end to end (``eval.every``, ``data.eval_files``, ``eval.n_samples``,
``eval.pass_threshold``, ``eval.max_prompts``; rlhf/loops/rl_eval.py), toy size on CPU.

Held-out prompts on the built-in task: it has only 8 prompt texts ("key k0" … "key k7", one key
each), so every row of ``builtin:keymap/eval`` repeats a training prompt; a held-out *text* is
impossible there. What can be held out is keys: this run trains on prompts of keys k0-k5 only and
evaluates two sources, ``seen`` (eval-split rows of k0-k5, the same texts as training) and
``heldout`` (k6, k7: never in a training prompt). The key → value table is random, so no policy can
infer k6's value from the others: the held-out source shows the per-source metrics at work, not
learning; the learning margin is asserted on ``seen`` and on the mean over both.

One GRPO run (module fixture) serves the end-to-end tests: eval metrics in metrics.jsonl and
MLflow, the learning margin, keep-best through rotation.

Evaluating changes no training metric: by construction (rlhf/loops/rl_eval.py: it calls only the
rollout engines' ``generate``, whose samples draw from per-sample generators, and the reward
functions; never the actor, reference, data source or KL controller), checked here without Ray
(``test_evaluator_touches_no_training_state``) and end to end by a second run without evaluation
whose every training metric equals the first's (``-m slow``: it costs a cluster start).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.helpers import record_learning, run_rl

STEPS, EVERY, N_SAMPLES, MAX_PROMPTS = 20, 5, 4, 24
EVAL_STEPS = [5, 10, 15, 20]  # the steps (counted from 1) after which an evaluation runs
HELD_OUT = {"k6", "k7"}
BEST = "eval/heldout/sampled/reward_mean"  # keep-best by an eval metric
MARGIN_SEEN, MARGIN_ALL = 0.3, 0.15  # greedy reward, last eval over first (measured: 0.72 and 0.36)
# algo.lr=5e-3: faster than the tiny model's default, so that 20 steps show learning
TOY = ["algo=grpo", "train.prompts_per_step=16", "rollout.max_response_tokens=4", "train.seed=1", "algo.lr=5e-3",
       f"eval.n_samples={N_SAMPLES}", f"eval.max_prompts={MAX_PROMPTS}", "eval.pass_threshold=1.0",
       f"checkpoint.every={EVERY}", "checkpoint.keep_last=1", f"checkpoint.best_metric={BEST}",
       "checkpoint.save_hf=false", "eval.before_training=true"]
KINDS = ("greedy/reward_mean", "greedy/pass_rate", "sampled/reward_mean", f"pass_at_{N_SAMPLES}", "prompts")


def _key(row: dict) -> str:
    return row["prompt"].split()[1]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Train on keys k0-k5; eval sources seen (k0-k5) and heldout (k6, k7), 16 rows each."""
    from rlhf.data.make import prompt_rows

    d = tmp_path_factory.mktemp("eval_data")
    train = [r for r in prompt_rows(1024, seed=0) if _key(r) not in HELD_OUT]
    held = prompt_rows(256, seed=10_000)  # the eval split's seed (rlhf.data.make.make)
    seen = [r for r in held if _key(r) not in HELD_OUT][:16]
    heldout = [r for r in held if _key(r) in HELD_OUT][:16]
    return {"train": _write(d / "train.jsonl", train), "eval": [_write(d / "seen.jsonl", seen),
                                                                _write(d / "heldout.jsonl", heldout)]}


def _data_args(data) -> list[str]:
    return [f"data.train_files=[{data['train']}]", f"data.eval_files=[{','.join(data['eval'])}]"]


@pytest.fixture(scope="module")
def eval_run(rl_env, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs") / "eval_on"
    code, rows = run_rl(TOY + _data_args(data) + [f"train.steps={STEPS}", f"eval.every={EVERY}"], out)
    assert code == 0
    return {"rows": rows, "dir": out}


def _evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/greedy/reward_mean" in r]


def test_held_out_keys_are_not_trained_on(data):
    train_keys = {_key(json.loads(x)) for x in open(data["train"])}
    held_keys = {_key(json.loads(x)) for x in open(data["eval"][1])}
    assert held_keys == HELD_OUT and not train_keys & HELD_OUT


def test_eval_metrics_every_n_steps_per_source(eval_run):
    ev = _evals(eval_run["rows"])
    assert [r["step"] for r in ev] == EVAL_STEPS
    for r in ev:
        for prefix in ("eval", "eval/seen", "eval/heldout"):
            for kind in KINDS:
                assert f"{prefix}/{kind}" in r, (r["step"], prefix, kind)
            for kind in KINDS[1:4]:
                assert 0.0 <= r[f"{prefix}/{kind}"] <= 1.0
        # eval.max_prompts=24 takes the first 24 rows: all 16 of seen.jsonl, 8 of heldout.jsonl
        assert (r["eval/prompts"], r["eval/seen/prompts"], r["eval/heldout/prompts"]) == (24, 16, 8)
        assert r["eval/greedy/reward_mean"] == pytest.approx(
            (16 * r["eval/seen/greedy/reward_mean"] + 8 * r["eval/heldout/greedy/reward_mean"]) / 24)
        assert r["time/eval"] > 0
    assert not any("eval/greedy/reward_mean" in r for r in eval_run["rows"] if r["step"] not in EVAL_STEPS)


def test_greedy_eval_reward_rises(eval_run):
    first, last = _evals(eval_run["rows"])[0], _evals(eval_run["rows"])[-1]
    seen = (first["eval/seen/greedy/reward_mean"], last["eval/seen/greedy/reward_mean"])
    both = (first["eval/greedy/reward_mean"], last["eval/greedy/reward_mean"])
    print(f"greedy eval reward, first -> last eval: seen {seen[0]:.3f} -> {seen[1]:.3f}, "
          f"all {both[0]:.3f} -> {both[1]:.3f}, held-out {first['eval/heldout/greedy/reward_mean']:.3f} -> "
          f"{last['eval/heldout/greedy/reward_mean']:.3f}")
    record_learning("rl/eval-greedy", "seen-prompt greedy reward gain", seen[1] - seen[0], MARGIN_SEEN)
    record_learning("rl/eval-greedy", "all-prompt greedy reward gain", both[1] - both[0], MARGIN_ALL)
    assert seen[1] >= seen[0] + MARGIN_SEEN, seen
    assert both[1] >= both[0] + MARGIN_ALL, both
    assert last["eval/seen/greedy/pass_rate"] > first["eval/seen/greedy/pass_rate"]


def test_eval_before_training_is_the_starting_policy(eval_run):
    """eval.before_training: the starting (random) policy's evaluation, logged once with the first
    step's metrics as eval_before/...; training then beats it on the seen keys."""
    rows = eval_run["rows"]
    assert [r["step"] for r in rows if "eval_before/greedy/reward_mean" in r] == [1]
    before, last = rows[0], _evals(rows)[-1]
    for kind in KINDS:
        assert f"eval_before/seen/{kind}" in before
    assert last["eval/seen/greedy/reward_mean"] >= before["eval_before/seen/greedy/reward_mean"] + MARGIN_SEEN


def test_eval_metrics_in_mlflow(eval_run):
    from mlflow.tracking import MlflowClient

    from rlhf.track import default_tracking_uri

    out = eval_run["dir"]
    client = MlflowClient(tracking_uri=default_tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id],
                              filter_string=f"tags.`rlhf.run_dir` = '{out.resolve()}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    by_step = {r["step"]: r for r in eval_run["rows"]}
    for prefix in ("eval", "eval/seen", "eval/heldout"):
        for kind in KINDS:
            hist = client.get_metric_history(runs[0].info.run_id, f"{prefix}/{kind}")
            assert sorted(h.step for h in hist) == EVAL_STEPS, (prefix, kind)
            for h in hist:
                assert h.value == pytest.approx(by_step[h.step][f"{prefix}/{kind}"])


def test_best_eval_checkpoint_survives_rotation(eval_run):
    from rlhf.ckpt import CheckpointManager

    rows = {r["step"]: r for r in eval_run["rows"]}
    saved = EVAL_STEPS  # checkpoint.every = eval.every: 5, 10, 15, 20
    # every checkpoint is ranked by the eval of its own weights (recorded in its COMPLETE marker)
    scores = {s: rows[s][BEST] for s in saved}
    best = max(saved, key=lambda s: (scores[s], -s))  # ties: the earliest
    kept = CheckpointManager(eval_run["dir"], every=EVERY, keep_last=1, best_metric=BEST).complete()
    print(f"{BEST} per checkpoint: {scores}; kept {[c.step for c in kept]}")
    assert [c.step for c in kept] == sorted({best, STEPS})  # keep_last=1: the newest, plus the best
    for c in kept:
        assert c.metric == pytest.approx(scores[c.step])
    assert not list((eval_run["dir"] / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_eval_does_not_change_training(eval_run, data, tmp_path):
    # the steps up to one past the second eval, without evaluation: every training metric equal
    n = EVAL_STEPS[1] + 1
    code, rows = run_rl(TOY + _data_args(data) + [f"train.steps={n}", "eval.every=0"], tmp_path / "eval_off")
    assert code == 0 and len(rows) == n
    compared = 0
    for a, b in zip(eval_run["rows"][:n], rows):
        keys = {k for k in a if not k.startswith(("time/", "throughput/", "perf/", "eval/", "eval_before/"))}
        assert keys == {k for k in b if not k.startswith(("time/", "throughput/", "perf/"))}, a["step"]
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-7), (a["step"], k, a[k], b[k])
            compared += 1
    assert compared > 100


# ----------------------------------------------------------------------------- without Ray


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"evaluation used a training role ({name})")


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Engine:
    """A rollout worker in this process: ``generate.remote`` runs the HF engine (``ray.get`` is patched)."""

    def __init__(self, engine):
        self.generate = _Remote(engine.generate)


@pytest.fixture
def evaluator(data, tmp_path, monkeypatch):
    import ray

    from rlhf.loops.rl_eval import make_evaluator
    from rlhf.models import load_model, load_tokenizer, resolve_model_path
    from rlhf.rewards import Rewards
    from rlhf.rollout.hf import HFEngine
    from tests.helpers import make_spec

    if not os.environ.get("RLHF_CACHE"):
        monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    spec = make_spec(TOY + _data_args(data) + [f"train.steps={STEPS}", f"eval.every={EVERY}",
                                               "tracking.backend=none"], tmp_path / "run")
    path = resolve_model_path(spec.model.path, spec.model)
    tok = load_tokenizer(path)
    engine = HFEngine(load_model(path, "causal_lm", "float32", pad_token_id=tok.pad_token_id), tok.eos_token_id,
                      tok.pad_token_id)
    cluster = type("Cluster", (), {"rollout": type("G", (), {"workers": [_Engine(engine), _Engine(engine)]})(),
                                   "reward_model": None, "actor": _Untouchable(), "critic": _Untouchable(),
                                   "reference": _Untouchable()})()
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    return make_evaluator(spec, cluster, tok, Rewards(spec.reward))


def test_evaluator_touches_no_training_state(evaluator):
    import random

    import numpy as np
    import torch

    before = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())
    first = evaluator.run()  # two engines: the prompts split in halves, as over two rollout workers
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1])
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    assert first == evaluator.run()  # seeds fixed per eval prompt: the same policy, the same metrics
    assert first["eval/prompts"] == MAX_PROMPTS and set(first) == {
        f"{p}/{k}" for p in ("eval", "eval/seen", "eval/heldout") for k in KINDS}


def test_eval_due_every_n_at_the_end_and_at_ranked_checkpoints(evaluator):
    from rlhf.ckpt import CheckpointManager

    # due(s) takes the loop's 0-based index; EVAL_STEPS are the 1-based step numbers the metrics carry
    assert [s + 1 for s in range(STEPS) if evaluator.due(s)] == EVAL_STEPS
    # best_metric=eval/...: a checkpoint that eval.every misses gets an evaluation of its own
    ckpt = CheckpointManager("/nonexistent", every=3, keep_last=1, best_metric=BEST)
    assert [s + 1 for s in range(STEPS) if evaluator.due(s, ckpt)] == sorted(
        set(EVAL_STEPS) | {s + 1 for s in range(STEPS) if (s + 1) % 3 == 0})
