"""What the GPU sync tests share: a vLLM engine and a trainer stand-in in one Ray cluster."""

from __future__ import annotations


def engine_and_trainer(model: str, gpus: int, share: float, gpu_memory_utilization: float, sleep: bool):
    """A Ray cluster of ``gpus`` GPUs holding one eager vLLM engine, started first (so its memory
    profile sees an idle GPU), then one ZeRO-3 trainer stand-in, each taking ``share`` of a GPU:
    ``(engine, trainer, tokenizer, the engine's start info)``."""
    import ray
    from transformers import AutoTokenizer

    from bench.common import SAFE_ENV, TrainerStub
    from rlhf.rollout.vllm import EngineConfig, VLLMEngine

    ray.init(num_gpus=gpus, num_cpus=8, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": dict(SAFE_ENV)})
    tok = AutoTokenizer.from_pretrained(model)
    cfg = EngineConfig(model_path=model, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=True,
                       enable_sleep_mode=sleep, max_model_len=1024, eos_token_id=tok.eos_token_id)
    engine = ray.remote(VLLMEngine).options(num_gpus=share, num_cpus=0).remote(cfg)
    info = ray.get(engine.info.remote())
    trainer = ray.remote(TrainerStub).options(num_gpus=share, num_cpus=0).remote(model, zero_stage=3, lr=1e-3)
    return engine, trainer, tok, info
