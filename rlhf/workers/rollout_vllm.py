"""``rlhf.rollout.vllm``'s engine under the path the benchmarks in ``bench/`` import."""

from rlhf.rollout.vllm import EngineConfig, VLLMEngine, create_vllm_engines, engine_config, logprob_mismatch  # noqa: F401
