"""``placement.sleep_rollout`` auto on a synchronous hybrid GPU run: vLLM stays awake through the
update where the plan's training phase holds it awake beside everything else as decided, and sleeps
otherwise, its reason naming the figure and the vLLM share that would keep it awake. The awake
figure is recomputed here from docs/memory.md's terms (the asleep figure, less what a sleeping
engine keeps, plus vLLM's whole share and the further engines' runtime)."""

from __future__ import annotations

from operator import attrgetter

import pytest

from rlhf.plan import memory
from rlhf.plan.advice import apply
from rlhf.plan.render import render_plan
from rlhf.rollout.vllm_kind import VLLM_ASLEEP_GB, VLLM_ENGINE_CONTEXT_GB
from rlhf.spec.build import config_dict
from tests.helpers import planned_spec

H200 = ["hardware=1xh200", "model=qwen2.5-0.5b"]
# BENCHMARKS §4's shape: 384-token sequences, vLLM's share 0.3 (TRL's default)
SHORT = ["rollout.max_prompt_tokens=128", "rollout.max_response_tokens=256", "rollout.gpu_memory_utilization=0.3"]


def _why(spec) -> str:
    return next(d.why for d in spec.auto if d.key == "placement.sleep_rollout")


@pytest.fixture(scope="module")
def short():
    """(auto, the same run with the engine asleep set by hand)."""
    return planned_spec([*H200, *SHORT]), planned_spec([*H200, *SHORT, "placement.sleep_rollout=true"])


def test_the_engine_stays_awake_where_the_training_phase_holds_it(short):
    spec, asleep = short
    assert spec.placement.sleep_rollout is False and asleep.placement.sleep_rollout is True
    est, est_asleep = memory.estimate(spec), memory.estimate(asleep)
    n = spec.layout.engines_per_device
    assert n == 2  # two engines per GPU, as when it sleeps: no engine is given up for it
    share = 0.3 * spec.hardware.device_memory_gb
    want = est_asleep.total("training phase") - n * VLLM_ASLEEP_GB + share + (n - 1) * VLLM_ENGINE_CONTEXT_GB
    assert est.figures["training phase"]["vLLM (awake)"] == pytest.approx(share)
    assert est.total("training phase") == pytest.approx(want)
    cap = memory.FIT_MARGIN * spec.hardware.device_memory_gb
    assert want <= cap and memory.fits(spec, est)
    assert _why(spec) == (f"the training phase holds the engines awake beside the update ({want:.0f} of {cap:.0f} "
                          "GB usable): no sleep and wake-up each step")
    # decided last: every other decision is the asleep run's
    for key in ("train.max_tokens_per_micro_batch", "train.zero_stage", "train.offload_optimizer",
                "placement.offload_train_state", "placement.rollout.engines_per_device", "model.compile_layers"):
        assert attrgetter(key)(spec) == attrgetter(key)(asleep), key
    assert "vLLM stays awake during training (auto: the training phase holds the engines awake" in render_plan(spec)


def test_an_awake_engine_starts_without_sleep_mode_and_a_saved_config_decides_again(short):
    from rlhf.rollout.vllm import engine_config

    spec, asleep = short
    assert engine_config(spec, "m").enable_sleep_mode is False  # vLLM's plain allocator
    assert engine_config(asleep, "m").enable_sleep_mode is True
    assert config_dict(spec)["placement"]["sleep_rollout"] == "auto"
    # on a GPU half the size the same run no longer holds it awake
    smaller = apply(spec, ["hardware.device_memory_gb=80"])
    assert smaller.placement.sleep_rollout is True


def test_the_engine_sleeps_where_awake_would_not_fit_and_the_reason_names_the_share_that_would():
    spec = planned_spec(H200)  # 2,048-token sequences, vLLM's share 0.5
    assert spec.placement.sleep_rollout is True
    # its training phase with the engines awake and every other choice as decided
    n, share = spec.layout.engines_per_device, 0.5 * spec.hardware.device_memory_gb
    gb = memory.estimate(spec).total("training phase") - n * VLLM_ASLEEP_GB + share + (n - 1) * VLLM_ENGINE_CONTEXT_GB
    cap = memory.FIT_MARGIN * spec.hardware.device_memory_gb
    assert gb > cap
    why = _why(spec)
    assert why.startswith(f"awake beside the update, the engines would make the training phase {gb:.0f} GB of "
                          f"{cap:.0f} usable; rollout.gpu_memory_utilization=")
    share = float(why.split("rollout.gpu_memory_utilization=")[1].split()[0])
    assert why.endswith(" would keep them awake")
    # the share named keeps them awake; the next tenth up does not
    assert apply(spec, [f"rollout.gpu_memory_utilization={share:g}"]).placement.sleep_rollout is False
    if share + 0.1 < spec.rollout.gpu_memory_utilization:
        assert apply(spec, [f"rollout.gpu_memory_utilization={share + 0.1:g}"]).placement.sleep_rollout is True


def test_no_share_is_named_where_a_smaller_one_would_starve_the_kv_cache():
    # 1.5B, 1,024 samples of 2,048 tokens on one engine: a share small enough for the engine to stay
    # awake leaves its KV cache less than the step's sequences need
    spec = planned_spec(["hardware=1xh200", "model=qwen2.5-1.5b", "rollout.gpu_memory_utilization=0.3"])
    assert spec.placement.sleep_rollout is True
    why = _why(spec)
    assert why.startswith("awake beside the update, the engines would make the training phase ")
    assert "rollout.gpu_memory_utilization=" not in why


def test_nothing_is_said_where_the_run_does_not_fit_asleep_or_no_engine_sleeps():
    over = planned_spec(["hardware=1xh200", "model=qwen2.5-7b"])  # full fine-tuning of 7B on one GPU
    assert not memory.fits(over)
    assert over.placement.sleep_rollout is True and _why(over) == ""
    for other in (planned_spec([]), planned_spec(["placement=disaggregated", "hardware=8xh100", *H200[1:]])):
        assert other.placement.sleep_rollout is True and _why(other) == ""  # CPU; engines on GPUs of their own
    # a value set by hand is the user's: nothing decided
    pinned = planned_spec([*H200, *SHORT, "placement.sleep_rollout=true"])
    assert all(d.key != "placement.sleep_rollout" for d in pinned.auto)


def test_out_of_memory_beside_an_awake_engine_names_its_sleep_first(short):
    # the plan's figure was wrong if the update runs out of memory beside the awake engine: the
    # first fix named is the engine asleep (what it costs is the step's sleep and wake-ups)
    from rlhf.plan.oom import oom_message

    spec, asleep = short
    msg = oom_message(spec, "update")
    assert msg.startswith("CUDA out of memory in the update phase: the plan estimated "
                          f"{memory.estimate(spec).total('training phase'):.1f} GB"), msg
    assert msg.split("Try ")[1].startswith("placement.sleep_rollout=true"), msg
    assert "placement.sleep_rollout" not in oom_message(asleep, "update")
