"""vLLM rollout engine + CUDA IPC weight sync on one GPU (hybrid placement).

One engine actor and one DeepSpeed ZeRO-3 trainer actor share GPU 0 (half a GPU each in Ray's
accounting). The trainer takes real optimizer steps, so every sync moves new weights; after each
sync vLLM's greedy tokens are compared with greedy decoding of an HF model holding the trainer's
current weights.
"""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.gpu

N_PROMPTS = 6
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup(model_05b):
    import ray

    from bench.checks import record
    from bench.common import prompts_ids
    from tests.gpu.engines import engine_and_trainer

    engine, trainer, tok, info = engine_and_trainer(model_05b, gpus=1, share=0.5, gpu_memory_utilization=0.35,
                                                    sleep=True)
    record("vllm_engine_start", **info)
    ray.get(trainer.setup_sync.remote("hybrid", [engine]))
    ray.get(trainer.offload.remote())  # hybrid: training states live in host memory between updates
    prompts = prompts_ids(tok, N_PROMPTS, seed=1)
    yield {"engine": engine, "trainer": trainer, "prompts": prompts, "tok": tok}
    ray.shutdown()


def _greedy_round(s, label):
    from bench.checks import greedy_round

    return greedy_round(s["engine"], s["trainer"], s["prompts"], NEW_TOKENS, label)


def test_generate_returns_ids_and_logprobs(setup):
    import ray

    from bench.checks import record
    import torch

    from rlhf.rollout.engine import Sampling
    from rlhf.algos.kl import logprob_mismatch

    engine, trainer, prompts = setup["engine"], setup["trainer"], setup["prompts"]
    samples = ray.get(engine.generate.remote(prompts, Sampling(n=4, max_new_tokens=48, temperature=1.0,
                                                                seeds=tuple(range(len(prompts))))))
    assert len(samples) == 4 * len(prompts)
    assert [s.prompt_index for s in samples] == [i for i in range(len(prompts)) for _ in range(4)]
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs) > 0
        assert all(lp <= 1e-4 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
    again = ray.get(engine.generate.remote(prompts, Sampling(n=4, max_new_tokens=48, temperature=1.0,
                                                              seeds=tuple(range(len(prompts))))))
    assert [s.response_ids for s in again] == [s.response_ids for s in samples], "seeded sampling must repeat"
    # sampled-token logprobs vs the trainer's recomputation (same weights, bf16)
    forced = ray.get(trainer.forced.remote([prompts[s.prompt_index] for s in samples],
                                           [s.response_ids for s in samples]))
    width = max(len(s.logprobs) for s in samples)
    roll = torch.zeros(len(samples), width)
    mine = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for i, (s, f) in enumerate(zip(samples, forced)):
        n = len(s.logprobs)
        roll[i, :n] = torch.tensor(s.logprobs)
        mine[i, :n] = torch.tensor(f["logp"])
        mask[i, :n] = 1
    mm = logprob_mismatch(roll, mine, mask)
    record("logprob_mismatch_fresh_weights", tokens=int(mask.sum()), **mm)
    assert mm["mismatch/logp_abs_mean"] < 1e-2


def test_greedy_matches_before_any_sync(setup):
    cmp, _, _ = _greedy_round(setup, "initial")
    assert cmp["digest_match"]
    assert cmp["consistent_prompts"] == cmp["prompts"], cmp


@pytest.mark.parametrize("round_, level", [(1, 1), (2, 2), (3, 1)])
def test_ipc_sync_after_training_step(setup, round_, level):
    """sleep -> train (states reloaded, stepped, offloaded) -> wake weights -> IPC sync -> wake KV -> greedy."""
    import ray

    from bench.checks import record

    engine, trainer = setup["engine"], setup["trainer"]
    before = ray.get(trainer.digest.remote())
    mem = ray.get(engine.sleep.remote(level=level))
    record(f"sleep_level{level}", **mem)
    assert mem["memory/vllm_freed_fraction"] >= 0.9, mem
    ray.get(trainer.reset_peak.remote())
    reload_s = ray.get(trainer.reload.remote())
    loss = ray.get(trainer.step.remote(seed=round_))
    tmem = ray.get(trainer.memory.remote())
    wake_w = ray.get(engine.wake_up.remote(["weights"]))
    stats = ray.get(trainer.sync.remote(bucket_mb=256))
    offload_s = ray.get(trainer.offload.remote())
    wake_kv = ray.get(engine.wake_up.remote(["kv_cache"]))
    record(f"ipc_sync_round{round_}", level=level, loss=loss, reload_s=reload_s, offload_s=offload_s,
           wake_weights_s=wake_w, wake_kv_s=wake_kv, trainer_peak_gib=tmem["peak_allocated_gib"],
           freed_gib=mem["memory/vllm_freed_gib"], fits=tmem["peak_allocated_gib"] < mem["memory/vllm_freed_gib"],
           **stats)
    cmp, _, after = _greedy_round(setup, f"after_ipc_sync{round_}")
    assert after["sum"] != before["sum"], "the training step did not change the weights"
    assert cmp["digest_match"], "vLLM's weights differ from the trainer's after the sync"
    assert cmp["consistent_prompts"] == cmp["prompts"], cmp
    assert tmem["peak_allocated_gib"] < mem["memory/vllm_freed_gib"]
