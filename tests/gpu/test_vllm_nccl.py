"""NCCL weight sync (disaggregated placement): trainer on GPU 0, vLLM engine on GPU 1.

The trainer's rank 0 and the vLLM worker share an NCCL group built for the purpose; each bucket is a
broadcast. Needs two GPUs (skipped otherwise).
"""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.gpu

N_PROMPTS = 6
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup(model_05b):
    from bench.checks import record

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import ray
    from transformers import AutoTokenizer

    from bench.common import SAFE_ENV, TrainerStub, prompts_ids
    from rlhf.rollout.vllm import EngineConfig, VLLMEngine

    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": dict(SAFE_ENV)})
    tok = AutoTokenizer.from_pretrained(model_05b)
    cfg = EngineConfig(model_path=model_05b, gpu_memory_utilization=0.5, enforce_eager=True,
                       enable_sleep_mode=False, max_model_len=1024, eos_token_id=tok.eos_token_id)
    engine = ray.remote(VLLMEngine).options(num_gpus=1, num_cpus=0).remote(cfg)
    trainer = ray.remote(TrainerStub).options(num_gpus=1, num_cpus=0).remote(model_05b, zero_stage=3, lr=1e-3)
    setup_s = ray.get(trainer.setup_sync.remote("disaggregated", [engine], [1]))
    record("nccl_group_setup", seconds=setup_s)
    yield {"engine": engine, "trainer": trainer, "prompts": prompts_ids(tok, N_PROMPTS, seed=2)}
    ray.shutdown()


@pytest.mark.parametrize("round_", [1, 2])
def test_nccl_sync_after_training_step(setup, round_):
    import ray

    from bench.checks import greedy_round, record

    engine, trainer, prompts = setup["engine"], setup["trainer"], setup["prompts"]
    before = ray.get(trainer.digest.remote())
    loss = ray.get(trainer.step.remote(seed=100 + round_))
    stats = ray.get(trainer.sync.remote(bucket_mb=256))
    record(f"nccl_sync_round{round_}", loss=loss, **stats)
    cmp, _, dt = greedy_round(engine, trainer, prompts, NEW_TOKENS, f"after_nccl_sync{round_}")
    assert dt["sum"] != before["sum"]
    assert cmp["digest_match"]
    assert cmp["consistent_prompts"] == cmp["prompts"], cmp
