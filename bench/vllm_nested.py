"""A rollout-engine plugin for the generation benchmarks: vLLM exactly as the product runs it, but with
the sampled-token logprobs returned the way they were before ``EngineConfig.flat_logprobs`` (a dict and a
``Logprob`` object per token). It prices that default inside the RL loop (scripts/engines_gpu.sh,
BENCHMARKS.md §10) with no configuration key in the product:

    rlhf-run ... rollout.engine=vllm_nested rollout.plugins=[bench.vllm_nested]
"""

from __future__ import annotations

from typing import Any

from rlhf.rollout.registry import register_engine
from rlhf.rollout.vllm_kind import VLLMKind


@register_engine
class NestedLogprobsVLLM(VLLMKind):
    """vLLM with nested per-token logprobs (``SamplingParams.flat_logprobs=False``)."""

    name = "vllm_nested"

    def create(self, spec: Any, tokenizer: Any, device: str, settings: dict[str, Any]) -> Any:
        from rlhf.rollout.vllm import VLLMEngine

        return VLLMEngine(spec, tokenizer, **{**settings, "flat_logprobs": False})
