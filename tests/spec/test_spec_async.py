"""Async rollouts in hybrid placement on a GPU (algo.async_steps=1): the build keeps the engine awake
and the training states resident (``placement.sleep_rollout`` / ``offload_train_state`` auto), the
plan's training phase then holds both, and a plan where they do not fit together stops with one line
naming the settings that make it fit. Figures recomputed from docs/memory.md's terms where they can be."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlhf.config import compose
from rlhf.plan import memory
from rlhf.plan.advice import apply
from rlhf.plan.render import render_plan
from rlhf.preflight import check_fits
from rlhf.spec.build import config_dict, needed_roles, typed_config
from rlhf.spec.errors import UserError
from rlhf.spec.rules import algo as algo_rules
from tests.helpers import assert_clear, planned_spec

H200 = ["hardware=1xh200", "model=qwen2.5-0.5b"]
ASYNC = ["algo.async_steps=1", "algo.tis_cap=2.0"]
VLLM_ASLEEP_GB = 1.0  # docs/memory.md: a sleeping vLLM keeps its CUDA context and graph pool


def _sections(*overrides: str) -> dict:
    return typed_config(compose(list(overrides)))


def _problems(s: dict) -> list[str]:
    return algo_rules.problems(s, needed_roles(s["algo"], s["reward"], s["model"].lora.rank))


def _with(s: dict, section: str, **values) -> dict:
    return {**s, section: replace(s[section], **values)}


@pytest.fixture(scope="module")
def both():
    """The 0.5B run on one H200, synchronous and async, at the same token budget (the null one of
    8 samples × 2,048 tokens: the GPU's auto budget differs between them, below). The synchronous
    run's engine asleep through the update (at this budget the plan would keep it awake too:
    test_spec_stay_awake.py), so that the two differ in that alone."""
    one = "placement.rollout.engines_per_device=1"  # one engine's share (two: test_spec_engines_per_device.py)
    return (planned_spec([*H200, one, "algo.tis_cap=2.0", "train.max_tokens_per_micro_batch=16384",
                          "placement.sleep_rollout=true"]),
            planned_spec([*H200, one, *ASYNC, "train.max_tokens_per_micro_batch=16384"]))


def test_the_awake_engine_leaves_a_smaller_auto_token_budget():
    """train.max_tokens_per_micro_batch null on a GPU: the largest power of two ≤ 32,768 that fits. The
    synchronous run's training phase has vLLM asleep and takes 32,768; beside the awake engine (u·M
    of the GPU) 32,768 does not fit and the budget stays at 16,384."""
    sync, spec = planned_spec([*H200, "algo.tis_cap=2.0"]), planned_spec([*H200, *ASYNC])
    assert sync.train.max_tokens_per_micro_batch == 32768
    assert spec.train.max_tokens_per_micro_batch == 16384
    why = next(d.why for d in spec.auto if d.key == "train.max_tokens_per_micro_batch")
    assert why.startswith("8 samples × 2048 tokens; 32768 would make the training phase ")
    # the advice weighs a smaller vLLM share at that budget (the memory it frees is not re-spent on a
    # larger auto budget, which would leave the figure no smaller)
    from rlhf.plan.oom import oom_message

    assert "rollout.gpu_memory_utilization=" in oom_message(spec, "update")
    # the synchronous run's larger budget leaves no room for its engine awake beside the update
    assert sync.placement.sleep_rollout is True


def test_hybrid_gpu_async_is_valid_and_keeps_the_engine_awake(both):
    sync, spec = both
    assert sync.placement.sleep_rollout is True and spec.placement.sleep_rollout is False
    assert spec.placement.offload_train_state is False
    why = {d.key: d.why for d in spec.auto}
    assert "algo.async_steps=1" in why["placement.sleep_rollout"]
    assert "algo.async_steps=1" in why["placement.offload_train_state"]
    # a saved config says auto again, and builds the same decision
    cfg = config_dict(spec)["placement"]
    assert cfg["sleep_rollout"] == "auto" and cfg["offload_train_state"] == "auto"


def test_the_training_phase_holds_the_awake_engine_beside_the_update(both):
    sync, spec = both
    est_sync, est = memory.estimate(sync), memory.estimate(spec)
    share = spec.rollout.gpu_memory_utilization * spec.hardware.device_memory_gb  # vLLM's whole share, u·M
    assert est.figures["training phase"]["vLLM (awake)"] == pytest.approx(share)
    assert est_sync.figures["training phase"]["vLLM asleep"] == pytest.approx(VLLM_ASLEEP_GB)
    # the same ZeRO and offload choices at this size: the difference is the engine's alone
    assert (sync.train.zero_stage, sync.train.offload_optimizer) == (spec.train.zero_stage, spec.train.offload_optimizer)
    assert est.total("training phase") == pytest.approx(est_sync.total("training phase") - VLLM_ASLEEP_GB + share)
    # generation alone (the first step's, an evaluation's) holds a part of that: no figure of its own
    assert set(est.figures) == {"training phase"} and set(est_sync.figures) == {"training phase", "generation phase"}
    assert memory.fits(spec, est)
    check_fits(spec)  # nothing raised
    text = render_plan(spec)
    line = next(l for l in text.splitlines() if l.startswith("async:"))
    assert_clear(line, "≤ 1 update stale", "algo.tis_cap=2", "vllm stays awake beside the update",
                 f"its {share:.1f} GB", f"({est.total('training phase'):.1f} GB; awake with algo.async_steps=0 too)",
                 "the training states stay on the GPU between updates")
    assert "vLLM stays awake during training (auto: algo.async_steps=1" in text


def test_the_vllm_engine_starts_without_sleep_mode_under_async(both):
    from rlhf.rollout.vllm import engine_config

    sync, spec = both
    assert engine_config(sync, "m").enable_sleep_mode is True  # its allocator can free the GPU for training
    assert engine_config(spec, "m").enable_sleep_mode is False  # awake throughout: vLLM's plain allocator


def test_async_that_does_not_fit_beside_the_engine_stops_with_the_fix():
    # 1.5B with vLLM's share at 0.8 of the GPU: the update and the awake engine need more than the GPU
    spec = planned_spec(["hardware=1xh200", "model=qwen2.5-1.5b", "rollout.gpu_memory_utilization=0.8", *ASYNC])
    sync = apply(spec, ["algo.async_steps=0"])
    # DeepSpeed's choices are the synchronous run's: it offloads nothing to make room for the awake engine
    assert (spec.train.zero_stage, spec.train.offload_optimizer) == (sync.train.zero_stage, sync.train.offload_optimizer)
    assert spec.train.offload_optimizer is False
    est = memory.estimate(spec)
    share = 0.8 * spec.hardware.device_memory_gb
    assert est.figures["training phase"]["vLLM (awake)"] == pytest.approx(share)
    assert est.total("training phase") > memory.FIT_MARGIN * spec.hardware.device_memory_gb
    with pytest.raises(UserError) as e:
        check_fits(spec)
    msg = str(e.value)
    assert_clear(msg, "algo.async_steps=1 keeps vllm awake beside the update", f"its {share:.1f} GB",
                 "the training phase needs", "rollout.gpu_memory_utilization=", "algo.async_steps=0 (fits")
    # the share it names: the largest tenth that fits with async kept, and a tenth more does not
    named = float(msg.split("rollout.gpu_memory_utilization=")[1].split()[0])
    assert "rollout.gpu_memory_utilization=%g (fits" % named in msg
    fixed = apply(spec, [f"rollout.gpu_memory_utilization={named:g}"])
    assert fixed.algo.async_steps == 1 and fixed.placement.sleep_rollout is False and memory.fits(fixed)
    bigger = apply(spec, [f"rollout.gpu_memory_utilization={named + 0.1:g}"])
    assert not memory.fits(bigger)
    # without async the engine sleeps through the update and the same run fits
    assert sync.placement.sleep_rollout is True and memory.fits(sync)
    assert "→ a setting that fits: rollout.gpu_memory_utilization=" in render_plan(spec)


def test_validation_refuses_a_sleeping_or_offloading_engine_under_async():
    s = _sections(*H200, *ASYNC)
    assert _problems(s) == []  # auto: awake and resident
    [msg] = _problems(_with(s, "placement", sleep_rollout=True))
    assert_clear(msg, "algo.async_steps=1", "placement.sleep_rollout=true", "placement.sleep_rollout=auto",
                 "algo.async_steps=0")
    [msg] = _problems(_with(s, "placement", offload_train_state=True))
    assert_clear(msg, "algo.async_steps=1", "placement.offload_train_state=true",
                 "placement.offload_train_state=auto", "algo.async_steps=0")
    assert _problems(_with(s, "placement", sleep_rollout=False, offload_train_state=False)) == []
    # engines of their own, or an engine that never sleeps: nothing moves, nothing to refuse
    dis = _sections("hardware=2xh200", "model=qwen2.5-0.5b", "placement=disaggregated", *ASYNC)
    assert _problems(_with(dis, "placement", sleep_rollout=True)) == []
    hf = _sections(*H200, *ASYNC, "rollout.engine=hf")
    assert _problems(_with(hf, "placement", sleep_rollout=True, offload_train_state=True)) == []
    # and the synchronous run may sleep and offload as before
    assert _problems(_with(_sections(*H200), "placement", sleep_rollout=True, offload_train_state=True)) == []


def test_sleep_rollout_takes_auto_true_or_false():
    from rlhf.spec.rules import train

    s = _sections()
    assert train.memory_problems(s) == []
    [msg] = train.memory_problems(_with(s, "placement", sleep_rollout="maybe"))
    assert_clear(msg, "placement.sleep_rollout='maybe' is not valid", "Use auto")


def test_the_plan_says_what_async_costs_elsewhere():
    dis = render_plan(planned_spec(["hardware=8xh100", "model=qwen2.5-0.5b", "placement=disaggregated", *ASYNC]))
    assert "async: step t+1 sampled during step t's update" in dis and "devices of their own: no memory cost" in dis
    cpu = render_plan(planned_spec(ASYNC))
    assert "processes of their own" in cpu
    assert "async:" not in render_plan(planned_spec(H200))


def test_out_of_memory_under_async_names_the_figure_holding_both(both):
    from rlhf.plan.oom import oom_message

    sync, spec = both
    est = memory.estimate(spec)
    for phase in ("generate", "update", "sync"):  # any phase: the engine generates beside the update
        msg = oom_message(spec, phase)
        assert_clear(msg, f"in the {phase} phase", f"{est.total('training phase'):.1f} GB", "for the training phase",
                     "rollout.gpu_memory_utilization=")
    assert "for the generation phase" in oom_message(sync, "generate")  # without async: the phase's own
