"""Actor-update throughput and MFU, with and without sample packing (one GPU).

The update: DeepSpeed ZeRO-2, bf16, torch AdamW (fused), forward + backward of a GRPO policy loss
(``rlhf.algos.losses.token_logprobs`` + ``policy_loss``, token-mean) over a rollout batch whose
prompt and response lengths vary like RL batches do, then one optimizer step.

* ``padded``: micro-batches of ``--micro`` samples in batch order, each padded to its longest
  sample (prompt left-padded, response right-padded, as ``rlhf.data.batch.collate`` lays it out),
  SDPA attention with the padding mask;
* ``packed_flex``: samples packed first-fit-decreasing into rows of ``--pack-tokens`` tokens,
  position ids restarting per sample, FlexAttention with the block-diagonal causal mask that
  transformers derives from the position ids (fully masked blocks are skipped);
* ``packed_sdpa``: the same rows with SDPA (the block-diagonal mask is dense: masked blocks are
  computed and thrown away).

FLOPs count real tokens only: 6·N·T (N = parameters doing matmuls: non-embedding + LM head) plus
causal attention 6·L·h·Σ s_i². MFU is reported against the measured bf16 matmul ceiling (8192³
``torch.matmul``, median) and against the 989 TFLOP/s datasheet figure. A profile of one update of
the fastest variant splits CUDA time into matmul / attention / optimizer / other kernels.

    python -m bench.train_mfu --preset qwen2.5-1.5b --samples 64
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

from bench.checks import record, write_json_out
from bench.common import SAFE_ENV, init_single_rank_dist, preset

DATASHEET_TFLOPS = 989.0


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    import torch

    xs = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
          for _ in range(3)]
    for a, b in xs:
        a @ b
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a, b = xs[i % 3]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def make_lengths(n: int, seed: int, max_total: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform 64..512, responses log-normal (median ~500,
    long tail) clipped so that prompt + response <= max_total."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(64, 512)
        r = int(min(max(16, rng.lognormvariate(math.log(500), 0.8)), max_total - p))
        out.append((p, r))
    return out


def pack_ffd(lengths: list[int], cap: int) -> list[list[int]]:
    """First-fit decreasing: lists of sample indices whose lengths sum to <= cap."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(cap - lengths[i])
    return rows


def build_microbatches(variant: str, lens, vocab: int, micro: int, cap: int, seed: int):
    """-> list of dicts of CUDA tensors: input_ids, position_ids, (attention_mask), loss_mask, advantages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (p + r,), generator=g) for p, r in lens]
    adv = torch.randn(len(lens), generator=g)
    mbs = []
    if variant == "padded":
        for s in range(0, len(lens), micro):
            idx = list(range(s, min(s + micro, len(lens))))
            P = max(lens[i][0] for i in idx)
            R = max(lens[i][1] for i in idx)
            ids = torch.zeros(len(idx), P + R, dtype=torch.long)
            attn = torch.zeros_like(ids)
            lmask = torch.zeros(len(idx), P + R, dtype=torch.float32)  # marks response tokens
            for b, i in enumerate(idx):
                p, r = lens[i]
                ids[b, P - p:P + r] = seqs[i]
                attn[b, P - p:P + r] = 1
                lmask[b, P:P + r] = 1
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            a = adv[idx][:, None].expand(-1, P + R).contiguous()
            mbs.append({"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": lmask, "adv": a})
    else:
        rows = pack_ffd([p + r for p, r in lens], cap)
        for row in rows:
            ids = torch.zeros(1, cap, dtype=torch.long)
            pos = torch.zeros(1, cap, dtype=torch.long)
            lmask = torch.zeros(1, cap, dtype=torch.float32)
            a = torch.zeros(1, cap)
            o = 0
            for i in row:
                p, r = lens[i]
                ids[0, o:o + p + r] = seqs[i]
                pos[0, o:o + p + r] = torch.arange(p + r)
                lmask[0, o + p:o + p + r] = 1
                a[0, o:o + p + r] = adv[i]
                o += p + r
            if o < cap:  # filler: its own sequence, no loss
                pos[0, o:] = torch.arange(cap - o)
            mbs.append({"input_ids": ids, "position_ids": pos, "loss_mask": lmask, "adv": a})
    return [{k: v.cuda(non_blocking=True) for k, v in mb.items()} for mb in mbs]


def flops_per_update(lens, n_matmul_params: int, layers: int, hidden: int) -> float:
    tokens = sum(p + r for p, r in lens)
    attn = 6 * layers * hidden * sum((p + r) ** 2 for p, r in lens)
    return 6 * n_matmul_params * tokens + attn


def run_variant(variant: str, p: dict, lens, args) -> dict:
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.algos.losses import policy_loss, token_logprobs
    from rlhf.models.builtin import hf_shape

    attn_impl = {"padded": "sdpa", "packed_flex": "flex_attention", "packed_sdpa": "sdpa"}[variant]
    cfg = Qwen2Config(**hf_shape(p), max_position_embeddings=8192, attn_implementation=attn_impl, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    mbs = build_microbatches(variant, lens, min(p["vocab"], 32000), args.micro, args.pack_tokens, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": len(mbs),
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    n_tokens_loss = sum(float(mb["loss_mask"].sum()) for mb in mbs)

    def update():
        for mb in mbs:
            kw = {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"]}
            if "attention_mask" in mb:
                kw["attention_mask"] = mb["attention_mask"]
            logits = engine(**kw).logits[:, :-1]
            tok = mb["input_ids"][:, 1:]
            mask = mb["loss_mask"][:, 1:]
            logp = token_logprobs(logits, tok)
            per_tok, _ = policy_loss(logp, logp.detach(), mb["adv"][:, 1:], mask)
            loss = (per_tok * mask).sum() / n_tokens_loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    update()  # warm-up (FlexAttention compiles here)
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        update()
        times.append(time.perf_counter() - t)
    prof = None
    if args.profile == variant:
        prof = profile_update(update)
    h, L, V = p["hidden"], p["n_layers"], p["vocab"]
    n_all = sum(x.numel() for x in model.parameters())
    n_matmul = n_all - V * h + V * h  # embedding lookup does no matmul; the (tied) LM head does one
    if not p["tie_embeddings"]:
        n_matmul = n_all - V * h
    med = statistics.median(times)
    fl = flops_per_update(lens, n_matmul, L, h)
    tokens = sum(a + b for a, b in lens)
    padded_tokens = sum(int(mb["input_ids"].numel()) for mb in mbs)
    out = {"variant": variant, "attn": attn_impl, "micro_batches": len(mbs), "real_tokens": tokens,
           "computed_tokens": padded_tokens, "pad_fraction": 1 - tokens / padded_tokens,
           "median_s": med, "runs_s": times, "warmup_s": warm, "tok_per_s": tokens / med,
           "tflops": fl / med / 1e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "profile": prof}
    del engine, model, opt, mbs
    torch.cuda.empty_cache()
    return out


def profile_update(update) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        update()
    cats = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        name = evt.key.lower()
        if not t or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if any(k in name for k in ("gemm", "nvjet", "cutlass", "matmul", "sm90_xmma", "cublas")):
            cats["matmul"] += t
        elif any(k in name for k in ("flash", "attention", "fmha", "flex", "triton_tem")):
            cats["attention"] += t
        elif any(k in name for k in ("adam", "multi_tensor", "foreach")):
            cats["optimizer"] += t
        else:
            cats["other"] += t
    total = sum(cats.values()) or 1.0
    return {k: {"ms": v / 1e3, "share": v / total} for k, v in cats.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--pack-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="padded,packed_flex")  # packed_sdpa: run it alone (memory)
    ap.add_argument("--profile", default="packed_flex")
    ap.add_argument("--grad-ckpt", action="store_true")
    args = ap.parse_args()
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    import torch

    torch.cuda.set_device(0)
    init_single_rank_dist()
    ceiling = matmul_ceiling()
    record("matmul_ceiling", tflops=ceiling, device=torch.cuda.get_device_name(0))
    p = preset(args.preset)
    lens = make_lengths(args.samples, seed=0, max_total=args.max_len)
    rows = []
    for v in [x for x in args.variants.split(",") if x]:
        try:
            r = run_variant(v, p, lens, args)
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
            r = {"variant": v, "error": f"{type(e).__name__}: {e}"[:500]}
            torch.cuda.empty_cache()
        if "tflops" in r:
            r["mfu_vs_measured"] = r["tflops"] / ceiling
            r["mfu_vs_datasheet"] = r["tflops"] / DATASHEET_TFLOPS
        rows.append(r)
        record(f"train_mfu_{v}", preset=args.preset, **r)
    res = {"preset": args.preset, "samples": args.samples, "lengths": lens, "matmul_ceiling_tflops": ceiling,
           "datasheet_tflops": DATASHEET_TFLOPS, "device": torch.cuda.get_device_name(0), "rows": rows}
    write_json_out("bench_train_mfu.json", res)
    tot = sum(a + b for a, b in lens)
    print(f"\nactor update, {args.preset}-shaped, {args.samples} samples, {tot} real tokens "
          f"(mean {tot / len(lens):.0f}, max {max(a + b for a, b in lens)}), ZeRO-2 bf16, 1 GPU; "
          f"matmul ceiling {ceiling:.0f} TFLOP/s measured, {DATASHEET_TFLOPS:.0f} datasheet")
    print(f"{'variant':<13}{'pad %':>7}{'s/update':>10}{'tok/s':>10}{'TFLOP/s':>9}{'MFU meas':>10}{'MFU 989':>9}{'mem GiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<13} error: {r['error'][:100]}")
            continue
        print(f"{r['variant']:<13}{100 * r['pad_fraction']:>7.1f}{r['median_s']:>10.3f}{r['tok_per_s']:>10.0f}"
              f"{r['tflops']:>9.0f}{100 * r['mfu_vs_measured']:>9.1f}%{100 * r['mfu_vs_datasheet']:>8.1f}%"
              f"{r['peak_mem_gib']:>9.1f}")
    for r in rows:
        if r.get("profile"):
            print(f"profile of one {r['variant']} update (CUDA time): " +
                  ", ".join(f"{k} {v['share'] * 100:.0f}% ({v['ms']:.0f} ms)" for k, v in r["profile"].items()))


if __name__ == "__main__":
    main()
