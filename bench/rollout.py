"""Rollout throughput: the framework's rollout step vs standalone ``vllm.LLM.generate``.

Same engine settings (``EngineConfig.llm_kwargs()`` for both), same work: N prompts of fixed length,
fixed response length (``ignore_eos``), temperature 1, sampled-token logprobs on, one GPU.

* standalone: ``LLM(**kwargs).generate(TokensPrompt..., SamplingParams(...))`` in this process, with
  vLLM's defaults otherwise (its engine core in a child process);
* framework: a ``VLLMEngine`` Ray actor (``rlhf.rollout.vllm``); one step = the driver's
  ``engine.generate.remote(prompt_ids, Sampling(...))`` returning ``Sample`` objects through Ray,
  plus collating them into the training batch (``rlhf.data.batch.collate``) when that module exists.
  Variants: engine core in the actor process (the default: CUDA IPC weight sync opens handles there)
  and in a child process (``multiprocessing=True``).

Runs alternate (standalone, framework, framework-mp, standalone, ...) after a warm-up each; the
table reports the median tokens/s and the ratio to standalone.

    python -m bench.rollout --preset qwen2.5-0.5b --prompts 512 --prompt-len 128 --gen-len 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.checks import record, write_json_out
from bench.common import SAFE_ENV, fixed_len_prompts, make_random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--util", type=float, default=0.28)
    ap.add_argument("--variants", default="framework,framework_mp")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)

    import ray
    import torch

    from rlhf.rollout.vllm import EngineConfig, VLLMEngine

    model = make_random_model(f"/tmp/rlhf-gpu/models/{args.preset}-random", args.preset)
    capture = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    cfg = EngineConfig(
        model_path=model, gpu_memory_utilization=args.util, enforce_eager=args.eager,
        enable_sleep_mode=True, max_model_len=args.prompt_len + args.gen_len + 16, seed=0,
        extra={} if args.eager else {"compilation_config": {"cudagraph_capture_sizes": capture}},
    )
    prompts = fixed_len_prompts(args.prompts, args.prompt_len, seed=0)
    work_tokens = args.prompts * args.gen_len

    # standalone first: it compiles, the framework engines then hit vLLM's compile cache
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**cfg.llm_kwargs())
    start_standalone = time.perf_counter() - t0
    sp = SamplingParams(n=1, max_tokens=args.gen_len, temperature=1.0, ignore_eos=True, logprobs=0,
                        detokenize=False, seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run_standalone() -> float:
        t = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == work_tokens
        return dt

    ray.init(num_gpus=1, num_cpus=8, include_dashboard=False, runtime_env={"env_vars": dict(SAFE_ENV)})
    variants = [v for v in args.variants.split(",") if v]
    actors, starts = {}, {}
    for v in variants:
        c = EngineConfig(**{**cfg.__dict__, "multiprocessing": v == "framework_mp"})
        t0 = time.perf_counter()
        actors[v] = ray.remote(VLLMEngine).options(num_gpus=0.3, num_cpus=0).remote(c)
        ray.get(actors[v].ready.remote())
        starts[v] = time.perf_counter() - t0

    try:
        from rlhf.data.batch import collate
    except Exception:  # noqa: BLE001 - the loop's batch module not there yet
        collate = None
    from rlhf.workers.rollout import Sampling

    sampling = Sampling(n=1, max_new_tokens=args.gen_len, temperature=1.0, seeds=tuple(range(len(prompts))))

    def run_framework(actor) -> float:
        t = time.perf_counter()
        samples = ray.get(actor.generate.remote(prompts, sampling, ignore_eos=True))
        if collate is not None:
            collate([prompts[s.prompt_index] for s in samples], [s.response_ids for s in samples], pad_id=0)
        dt = time.perf_counter() - t
        assert sum(len(s.response_ids) for s in samples) == work_tokens
        return dt

    # warm-up (also fills any lazily captured graphs)
    run_standalone()
    for a in actors.values():
        run_framework(a)
    times: dict[str, list[float]] = {"standalone": [], **{v: [] for v in variants}}
    for _ in range(args.reps):
        times["standalone"].append(run_standalone())
        for v, a in actors.items():
            times[v].append(run_framework(a))

    base = statistics.median(times["standalone"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "median_s": med, "tok_per_s": work_tokens / med, "ratio": base / med,
                     "runs_s": ts, "start_s": start_standalone if name == "standalone" else starts[name]})
    res = {"preset": args.preset, "prompts": args.prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
           "cuda_graphs": not args.eager, "device": torch.cuda.get_device_name(0), "rows": rows}
    record(f"rollout_{args.preset}", **res)
    write_json_out(f"bench_rollout_{args.preset}.json", res)
    print(f"\nrollout, {args.preset}-shaped random model, {args.prompts} prompts x {args.prompt_len} -> "
          f"{args.gen_len} tokens, ignore_eos, T=1, logprobs on, {'eager' if args.eager else 'CUDA graphs'}")
    print(f"{'variant':<16}{'median s':>10}{'tok/s':>12}{'vs standalone':>15}{'start s':>10}")
    for r in rows:
        print(f"{r['variant']:<16}{r['median_s']:>10.3f}{r['tok_per_s']:>12.0f}{r['ratio']:>15.3f}{r['start_s']:>10.1f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
