"""rollout.seeded: null resolves by engine (seeded with HF generate, unseeded with vLLM); HF
generate with seeds switched off is a config error naming the fix."""

import pytest

from rlhf.spec.errors import SpecError

from tests.helpers import planned_spec


def test_auto_by_engine():
    assert planned_spec([]).rollout.seeded is True  # CPU: HF generate
    gpu = planned_spec(["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"])
    assert gpu.rollout_engine == "vllm" and gpu.rollout.seeded is False
    pinned = planned_spec(["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent", "rollout.seeded=true"])
    assert pinned.rollout.seeded is True


def test_sampling_carries_seeds_only_when_seeded():
    from rlhf.loops.rl import sampling_for

    assert len(sampling_for(planned_spec([]), 3, 0, 4).seeds) == 4
    gpu = planned_spec(["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"])
    assert sampling_for(gpu, 3, 0, 4).seeds == ()


def test_hf_engine_needs_seeds():
    with pytest.raises(SpecError) as info:
        planned_spec(["rollout.seeded=false"])
    assert "rollout.seeded=false" in str(info.value) and "rollout.seeded=true" in str(info.value)
