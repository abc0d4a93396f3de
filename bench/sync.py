"""Weight-sync throughput: trainer (DeepSpeed ZeRO-3, one GPU) -> vLLM engine.

* ``--mode ipc``: trainer and engine on the same GPU (hybrid placement), CUDA IPC buckets;
* ``--mode nccl``: trainer on GPU 0, engine on GPU 1 (disaggregated), NCCL broadcast buckets.

For each bucket size: one warm-up sync, then ``--reps`` timed syncs. GB/s counts the bf16 bytes of
the model (each tensor once; tied embeddings once). The time covers the ZeRO-3 gather per bucket,
packing, the transfer and vLLM's ``load_weights``, up to the engine confirming the last bucket.

    python -m bench.sync --mode ipc --presets qwen2.5-0.5b,qwen2.5-1.5b --buckets 128,512,1024
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench.checks import record, write_json_out
from bench.common import SAFE_ENV, TrainerStub, make_random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ipc", "nccl"], default="ipc")
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--buckets", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    import ray
    import torch

    from rlhf.rollout.vllm import EngineConfig, VLLMEngine

    ngpu = 1 if args.mode == "ipc" else 2
    if torch.cuda.device_count() < ngpu:
        print(f"sync {args.mode}: needs {ngpu} GPUs, {torch.cuda.device_count()} present: not run")
        return
    ray.init(num_gpus=ngpu, num_cpus=8, include_dashboard=False, runtime_env={"env_vars": dict(SAFE_ENV)})
    share = 0.5 if args.mode == "ipc" else 1.0
    rows = []
    for preset in [p for p in args.presets.split(",") if p]:
        model = make_random_model(f"/tmp/rlhf-gpu/models/{preset}-random", preset)
        cfg = EngineConfig(model_path=model, gpu_memory_utilization=0.25, enforce_eager=True,
                           enable_sleep_mode=args.mode == "ipc", max_model_len=1024)
        # both start at once (vLLM's KV cache may come out smaller; the transfer does not care)
        engine = ray.remote(VLLMEngine).options(num_gpus=share, num_cpus=0).remote(cfg)
        trainer = ray.remote(TrainerStub).options(num_gpus=share, num_cpus=0).remote(model, zero_stage=3)
        mode = "hybrid" if args.mode == "ipc" else "disaggregated"
        setup_s = ray.get(trainer.setup_sync.remote(mode, [engine], [1]))
        for mb in [int(b) for b in args.buckets.split(",") if b]:
            ray.get(trainer.sync.remote(bucket_mb=mb))  # warm-up (first IPC opens, NCCL buffers)
            runs = [ray.get(trainer.sync.remote(bucket_mb=mb)) for _ in range(args.reps)]
            secs = [r["sync_seconds"] for r in runs]
            med = statistics.median(secs)
            mid = runs[secs.index(med)] if med in secs else runs[0]
            row = {"preset": preset, "mode": args.mode, "bucket_mb": mb, "gb": runs[0]["sync_bytes"] / 1e9,
                   "buckets": runs[0]["sync_buckets"], "median_s": med, "gbps": runs[0]["sync_bytes"] / med / 1e9,
                   "runs_s": secs, "setup_s": setup_s, "pack_s": mid.get("sync_pack_seconds"),
                   "wait_s": mid.get("sync_wait_seconds"), "engine_load_s": mid.get("sync_engine_load_seconds")}
            rows.append(row)
            record(f"sync_{args.mode}", **row)
        # correctness of the last sync (weights equal)
        dv, dt = ray.get([engine.weight_digest.remote(), trainer.digest.remote()])
        from bench.checks import digests_match

        record(f"sync_{args.mode}_digest", preset=preset, match=digests_match(dv, dt))
        ray.kill(trainer)
        ray.kill(engine)
    res = {"mode": args.mode, "device": torch.cuda.get_device_name(0), "rows": rows}
    write_json_out(f"bench_sync_{args.mode}.json", res)
    print(f"\nweight sync, {args.mode} ({'same GPU, CUDA IPC' if args.mode == 'ipc' else 'GPU0 -> GPU1, NCCL'}), "
          "trainer ZeRO-3")
    print(f"{'model':<16}{'bucket MB':>10}{'GB':>8}{'median s':>10}{'GB/s':>8}{'pack s':>9}{'wait s':>9}{'load s':>9}")
    f = lambda x: f"{x:>9.3f}" if isinstance(x, float) else f"{'-':>9}"  # noqa: E731
    for r in rows:
        print(f"{r['preset']:<16}{r['bucket_mb']:>10}{r['gb']:>8.2f}{r['median_s']:>10.3f}{r['gbps']:>8.1f}"
              f"{f(r['pack_s'])}{f(r['wait_s'])}{f(r['engine_load_s'])}")
    print("pack: trainer gathers (ZeRO-3) + packs, summed over buckets; wait: trainer blocked on the engine; "
          "load: engine opens the buffer + load_weights, summed")
    ray.shutdown()


if __name__ == "__main__":
    main()
