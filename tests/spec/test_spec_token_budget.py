"""train.max_tokens_per_micro_batch null (rlhf.plan.auto._token_budget): RL on GPUs takes the largest
power of two ≤ 32,768, not below micro-batch samples × the longest sequence, at which every GPU
figure fits with the states where the build put them, or, where that product would put Adam's state
in host memory, the largest power of two below it (down to 8,192) that keeps it on the GPU; CPU runs
keep that product; an explicit value is kept. The ZeRO stage at one rank (ZeRO-1; ZeRO-2 with the optimizer offloaded) is decided beside it."""

from __future__ import annotations

import pytest

from rlhf.plan.auto import MAX_AUTO_TOKENS
from rlhf.plan.memory import estimate, over_limit
from tests.helpers import planned_spec

# the §4 loop's recipe shape (grpo_qwen05_random_1xh200): 16 samples × (128 + 256) = 6,144 tokens at null
GPU = ["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent", "train.micro_batch_size=16",
       "rollout.max_prompt_tokens=128", "rollout.max_response_tokens=256"]
PRODUCT = 16 * (128 + 256)


def _decision(spec):
    return next((d for d in spec.auto if d.key == "train.max_tokens_per_micro_batch"), None)


def _fits(overrides: list[str], t: int, placed=None) -> bool:
    """Whether every GPU figure fits at budget ``t`` with the states where ``placed`` (a built spec) has them."""
    pins = [f"train.zero_stage={placed.train.zero_stage}", f"train.offload_optimizer={placed.train.offload_optimizer}",
            f"placement.offload_train_state={placed.placement.offload_train_state}"] if placed else []
    spec = planned_spec([*overrides, *pins, f"train.max_tokens_per_micro_batch={t}"])
    return not over_limit(spec, estimate(spec))


@pytest.mark.parametrize("memory_gb, expect", [(None, 32768), (60, 16384), (38, PRODUCT)])
def test_gpu_null_takes_the_largest_power_of_two_that_fits(memory_gb, expect):
    """141 GB: 32,768 (the cap; 65,536 would fit too); 60 GB: 32,768 would not fit, 16,384 does;
    38 GB: not even 8,192 fits, so the product stays (and the reason names what 8,192 would need)."""
    overrides = GPU + ([f"hardware.device_memory_gb={memory_gb}"] if memory_gb else [])
    spec = planned_spec(overrides)
    d = _decision(spec)
    assert spec.train.max_tokens_per_micro_batch == d.value == expect and d.given is None
    assert _fits(overrides, expect, spec)
    if expect == MAX_AUTO_TOKENS:
        assert _fits(overrides, 2 * expect, spec)  # room for more, but no faster (BENCHMARKS §12): capped
        assert d.why.startswith(f"the largest power of two ≤ {MAX_AUTO_TOKENS} with the training phase fitting (")
        assert d.why.endswith(f"not below 16 samples × 384 tokens = {PRODUCT}")
    elif expect > PRODUCT:
        assert not _fits(overrides, 2 * expect, spec)
    else:  # (with the states placed otherwise, e.g. offloaded, 8,192 might fit: the budget does not move them)
        assert not _fits(overrides, 8192, spec)
        assert d.why.startswith("16 samples × 384 tokens; 8192 would make the training phase ")
    # the states were placed at the chosen budget: the ZeRO reason and the figures agree, and the
    # choice at one rank is ZeRO-1 with the optimizer on the GPU
    assert spec.train.zero_stage == 1 and spec.train.offload_optimizer is False


def test_the_plan_prints_the_budget_and_why(capsys):
    from rlhf.cli import main

    assert main([*GPU, "--plan"]) == 0
    out = capsys.readouterr().out
    assert (f"≤ 32768 tokens per micro-batch (train.max_tokens_per_micro_batch null: the largest power of two "
            f"≤ 32768 with the training phase fitting (") in out
    assert "· ZeRO-1 · seed" in out


def test_explicit_budget_and_cpu_runs_keep_their_value():
    spec = planned_spec([*GPU, "train.max_tokens_per_micro_batch=4096"])
    assert spec.train.max_tokens_per_micro_batch == 4096 and _decision(spec) is None
    # CPU: micro-batch samples × the longest sequence, as the CPU tests' numerics always had it
    spec = planned_spec([])
    r = spec.rollout
    assert spec.train.max_tokens_per_micro_batch == spec.batch.micro_batch_size * (
        r.max_prompt_tokens + r.max_response_tokens)
    assert _decision(spec).why == f"{spec.batch.micro_batch_size} samples × {r.max_prompt_tokens + r.max_response_tokens} tokens"
    assert spec.train.zero_stage == 0  # CPU: no ZeRO, before and after the one-rank change
    # a product at or above the cap stays as it is
    spec = planned_spec([*GPU, "train.micro_batch_size=128"])
    assert spec.train.max_tokens_per_micro_batch == 128 * 384 == _decision(spec).value


def test_sft_does_not_get_a_gpu_budget():
    spec = planned_spec(["algo=sft", "model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"])
    assert "power of two" not in _decision(spec).why


# BENCHMARKS §8's 512-token + KL workload at 1.5B on an 85-GB H100: 16 samples × (128 + 512) = 10,240 tokens
H100_15B = ["model=qwen2.5-1.5b", "hardware=1xh100", "model.path=/nonexistent", "train.micro_batch_size=16",
            "rollout.max_prompt_tokens=128", "rollout.max_response_tokens=512", "algo.kl.coef=0.001",
            "hardware.device_memory_gb=85"]


def test_gpu_null_goes_below_the_product_to_keep_adams_state_on_the_gpu():
    """At 10,240 tokens Adam's state does not fit beside the rest, and the host's optimizer (ZeRO-2,
    eager layers) ran that update at 23 % MFU; 8,192 tokens keep it on the GPU (ZeRO-1, compiled)."""
    spec = planned_spec(H100_15B)
    d = _decision(spec)
    assert (spec.train.max_tokens_per_micro_batch, spec.train.offload_optimizer, spec.train.zero_stage) == (8192, False, 1)
    assert spec.model.compile_layers is True and spec.placement.offload_train_state is False
    assert d.given is None and d.why.startswith(
        "the largest power of two below 16 samples × 640 tokens = 10240 at which Adam's state stays on the GPU (")
    assert _fits(H100_15B, 8192, spec) and not _fits(H100_15B, 10240, spec)  # why it went below
    # the states' reasons are decided at 8,192: the plan's optimizer line is not the offloaded one
    assert not any(x.key == "train.offload_optimizer" and x.why for x in spec.auto)


def test_the_optimizer_stays_on_the_host_where_no_budget_down_to_8192_frees_it():
    # the optimizer set on the host: the budget rises as before
    spec = planned_spec([*H100_15B, "train.offload_optimizer=true"])
    assert spec.train.max_tokens_per_micro_batch > 10240 and spec.train.offload_optimizer is True
    # PPO at 1.5B on an 85-GB H100: the actor's and the critic's Adam do not fit at 8,192 either;
    # the optimizer stays on the host and the budget is not below the product
    spec = planned_spec([*H100_15B, "algo=ppo"])
    assert spec.train.offload_optimizer is True and spec.train.max_tokens_per_micro_batch >= 10240
    assert not _fits([*H100_15B, "algo=ppo", "train.offload_optimizer=false", "train.zero_stage=1"], 8192)
    assert "Adam's state stays on the GPU" not in _decision(spec).why
