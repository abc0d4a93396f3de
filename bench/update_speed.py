"""The actor update's forward + backward as the trainer runs it, variant by variant, in one process.

    python -m bench.update_speed --preset qwen2.5-0.5b --samples 256 --prompt 40 --response 256

Same random model (``bench.make_model`` shapes, bf16 on the GPU, no DeepSpeed), same packed
micro-batches (``rlhf.data.packing``, ``--tokens`` per micro-batch), forward through the backbone
with ``rlhf_varlen`` attention and ``rlhf.algos.logprobs_from_hidden`` (log-probs + entropy),
backward of ``sum(logp) + 0.01 sum(entropy)``. Variants:

* ``base``: as the trainer runs by default (written-out LM-head backward, eager elementwise);
* ``compiled_head``: the head's elementwise passes compiled by torch.compile (``train.compile_logprobs``);
* ``ckpt_head``: the LM head through the generic checkpointed-autograd path (what a LoRA-adapted
  or ZeRO-3 head takes);
* ``liger``: ``base`` with Liger's RMSNorm/SwiGLU/RoPE kernels (``model.liger_kernels=true``).

Prints seconds per update, model TFLOP/s (``rlhf.models.flops``) and MFU of ``--peak`` TFLOP/s,
ratios to ``base`` taken in this one run, and a CUDA-time profile of ``base`` by kernel kind.

``--head-memory 4096,16384,...`` measures what the plan calls the log-prob pass
(``rlhf.plan.memory.logprob_pass_gb``): the GPU memory that ``logprobs_from_hidden`` forward +
backward adds above its inputs, for that many predicted tokens, eager and compiled, next to the
plan's figure: whether it is bounded by one chunk or grows with tokens × vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _batch(samples: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from rlhf.data.batch import collate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (prompt,), generator=g).tolist() for _ in range(samples)]
    lens = torch.randint(max(1, response // 4), response + 1, (samples,), generator=g).tolist()
    resps = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    return collate(prompts, resps, pad_id=0, response_width=response)


def _model(path: str, liger: bool):
    from rlhf.models.load import apply_liger, load_model
    from rlhf.models.varlen import use_varlen

    m = load_model(path, "causal_lm", "bfloat16")
    if liger:
        apply_liger(m)
    use_varlen(m)
    return m.cuda().train()


class _Wrapped(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x)


def _update(model, micro, head, compile: bool) -> None:
    from rlhf.algos import logprobs_from_hidden
    from rlhf.models.varlen import packed_kwargs

    for p in micro:
        hidden = model.base_model(**packed_kwargs(p, "cuda")).last_hidden_state[0][p["pred_index"].cuda()]
        lp, ent = logprobs_from_hidden(hidden, head, p["targets"].cuda(), 1.0, True, vocab=model.config.vocab_size,
                                       compile=compile)
        (lp.sum() + 0.01 * ent.sum()).backward()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per packed micro-batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak", type=float, default=989.0)
    ap.add_argument("--variants", default="base,compiled_head,liger")
    ap.add_argument("--head-memory", default="", help="predicted-token counts for the log-prob pass's memory")
    a = ap.parse_args(argv)
    if a.head_memory:
        return head_memory(a)
    from bench.common import make_random_model
    from rlhf.data.packing import pack, real_lengths, token_groups
    from rlhf.models.flops import flop_shape

    path = a.model or make_random_model(f"/tmp/rlhf-gpu/models/{a.preset}-random", a.preset)
    results = {}
    for variant in a.variants.split(","):
        model = _model(path, liger="liger" in variant)
        head = model.get_output_embeddings()
        if variant == "ckpt_head":
            head = _Wrapped(head)
        b = _batch(a.samples, a.prompt, a.response, model.config.vocab_size)
        plen, rlen = real_lengths(b)
        micro = [pack(b, rows) for rows in token_groups((plen + rlen).tolist(), a.tokens)]
        shape = flop_shape(model)
        flops = sum(3 * shape.forward(float(p["input_ids"].numel()), float(len(p["targets"])),
                                      float(p["sq_lengths"])) for p in micro)
        t0 = time.perf_counter()
        _update(model, micro, head, "compiled" in variant)  # warm-up (and compilation)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        times = []
        for _ in range(a.repeats):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            _update(model, micro, head, "compiled" in variant)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        s = sorted(times)[len(times) // 2]
        results[variant] = {"s": s, "warmup_s": warm, "tflops": flops / s / 1e12, "mfu": flops / s / 1e12 / a.peak,
                            "micro_batches": len(micro), "tokens": sum(int(p["input_ids"].numel()) for p in micro),
                            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if variant == "base":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _update(model, micro, head, "compiled" in variant)
                torch.cuda.synchronize()
            kinds: dict[str, float] = {}
            for ev in prof.key_averages():
                name = ev.key.lower()
                kind = ("matmul" if any(k in name for k in ("gemm", "matmul", "cutlass", "sm90", "nvjet")) else
                        "attention" if any(k in name for k in ("flash", "attn", "fmha")) else "other")
                kinds[kind] = kinds.get(kind, 0.0) + getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0))
            total = sum(kinds.values()) or 1.0
            results[variant]["cuda_time_share"] = {k: round(v / total, 3) for k, v in kinds.items()}
            results[variant]["top_kernels"] = [
                (ev.key[:60], round(getattr(ev, "device_time_total", 0) / 1e3, 1))
                for ev in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:12]]
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = results.get("base", {}).get("s")
    print(f"update fwd+bwd, {a.preset}, {a.samples} samples × ({a.prompt} + ≤{a.response}) tokens, "
          f"≤ {a.tokens} tokens per micro-batch")
    print("| variant | s / update | TFLOP/s | MFU | vs base |")
    print("| --- | --- | --- | --- | --- |")
    for v, r in results.items():
        print(f"| {v} | {r['s']:.3f} | {r['tflops']:.0f} | {r['mfu']:.1%} | {base / r['s'] if base else 0:.2f} |")
    print("RESULT " + json.dumps({"name": "update_speed", **results}))
    return 0


def head_memory(a) -> int:
    """The log-prob pass's working set (see the module doc), one figure per token count and mode."""
    from bench.common import make_random_model
    from rlhf.algos import logprobs_from_hidden
    from rlhf.plan.memory import CUDA_KEEP_LOGITS, CUDA_LOGITS_CHUNK, GB, logprob_pass_gb
    from rlhf.spec.schema import ModelSpec

    path = a.model or make_random_model(f"/tmp/rlhf-gpu/models/{a.preset}-random", a.preset)
    model = _model(path, liger=False)
    head, V, h = model.get_output_embeddings(), model.config.vocab_size, model.config.hidden_size
    shape = ModelSpec(name=a.preset, path=path, n_layers=1, hidden=h, intermediate=1, n_heads=1, n_kv_heads=1,
                      vocab=V)
    rows = []
    for compile in (False, True):
        for t in (int(x) for x in a.head_memory.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            targets = torch.randint(0, V, (t,), device="cuda", generator=g)
            for _ in range(2):  # the first call compiles; the second is measured
                model.zero_grad(set_to_none=True)
                hidden.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                lp, ent = logprobs_from_hidden(hidden, head, targets, 1.0, True, vocab=V, compile=compile)
                (lp.sum() + 0.01 * ent.sum()).backward()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            rows.append({"tokens": t, "compiled": compile, "peak_gb": peak / GB, "bytes_per_logit": peak / (t * V),
                         "plan_gb": logprob_pass_gb(shape, t, CUDA_LOGITS_CHUNK, zero_stage=0, keep=CUDA_KEEP_LOGITS,
                                                    compiled=compile)})
            del hidden, targets, lp, ent
            torch.cuda.empty_cache()
    print(f"log-prob pass memory, {a.preset} (vocab {V}, hidden {h}): measured above its inputs vs the plan")
    print("| predicted tokens | compiled | measured GB | bytes per token × vocab | plan GB |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['compiled']} | {r['peak_gb']:.2f} | {r['bytes_per_logit']:.2f} | {r['plan_gb']:.2f} |")
    print("RESULT " + json.dumps({"name": "head_memory", "preset": a.preset, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
