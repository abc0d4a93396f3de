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

    from bench.common import prompts_ids
    from tests.gpu.engines import engine_and_trainer

    engine, trainer, tok, _ = engine_and_trainer(model_05b, gpus=2, share=1, gpu_memory_utilization=0.5, sleep=False)
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
