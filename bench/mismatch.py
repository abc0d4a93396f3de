"""Where the trainer-vs-vLLM log-prob mismatch comes from, preset by preset (issue 16, item 6).

For each random-weight model (``bench.make_model`` shapes; each model dir deleted after its preset),
the rollout engine samples ``--prompts`` prompts (random lengths) × ``--gen-len`` tokens at
temperature 1 with the sampled tokens' log-probs (vLLM ``raw_logprobs``: log_softmax of the raw
logits), then the same tokens are scored by

* ``trainer``: the product's path in bf16: packed micro-batches (``rlhf.data.packing``),
  ``rlhf_varlen`` attention, ``rlhf.algos.logprobs_from_hidden``, as ``rlhf.workers.model`` runs it
  (DeepSpeed 0.19's bf16 engine casts parameters only; the RoPE ``inv_freq`` buffer stays float32);
* ``trainer_wide_head``: the same hidden states, the LM head in float32 (float64 on CPU);
* ``trainer_sdpa``: the packed pass with the varlen kernel off (padded SDPA inside each pack);
* ``hf_padded``: plain HF forward of left-padded rows, ``log_softmax(logits.float())``;
* ``engine_prefill`` (GPU): vLLM's prompt log-probs of the same sequences (prefill, not decode);
  ``engine_fp32_head`` (``--fp32-head``): the same from an engine with ``hf_overrides={"head_dtype":
  "float32"}``, where this vLLM has it;
* ``ref32`` (GPU) and ``ref``: the same weights in float32 and float64, padded, plain log-softmax.

Per preset: mean/p99/max |path − ref| and chosen pairs (``engine-trainer`` is what the RL loop logs
as ``mismatch/logp_abs_mean``); the model's logit std, entropy and sampled-logit size; the relative
error of the final hidden states and of the residual stream layer by layer; two predictions of
|Δ log p| (bf16 rounding of the sampled logit, ulp/4; hidden-state noise × logit std × sqrt(2/π));
|path − ref| by absolute position, by entropy and by sampled-logit size (quartiles).

    python -m bench.mismatch                 # GPU: 0.5B, 1.5B, 7B shapes (bf16 vs float64)
    python -m bench.mismatch --cpu-test      # CPU: tiny model, HF sampling, float32 vs float64
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

KEY_PATHS = ("engine", "trainer", "trainer_wide_head", "hf_padded")
PAIRS = (("engine", "trainer"), ("engine", "engine_prefill"), ("engine_prefill", "trainer"),
         ("engine_fp32_head", "trainer_wide_head"), ("trainer", "hf_padded"), ("trainer", "trainer_sdpa"),
         ("trainer", "trainer_wide_head"), ("ref32", "ref"))
SUMMARY = ("engine-trainer", "engine-ref", "trainer-ref", "hf_padded-ref", "trainer_wide_head-ref",
           "engine_fp32_head-trainer_wide_head", "trainer-trainer_sdpa")
POSITION_EDGES = (0, 128, 256, 512, 768, 1024, 1 << 30)


# ---------------------------------------------------------------------------------- the rollout engine

def _vllm_worker(job_file: str) -> int:
    """In a child process (its GPU memory goes with it): one vLLM engine with the product's settings
    (``EngineConfig``), sampling when no responses are given, then prompt log-probs."""
    from vllm import SamplingParams, TokensPrompt

    from rlhf.rollout.vllm import EngineConfig, VLLMEngine

    job = json.loads(Path(job_file).read_text())
    extra: dict = {"logprobs_mode": "raw_logprobs"}  # = processed_logprobs (the runs' mode) at T=1
    if not job["eager"]:
        extra["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}
    if job["fp32_head"]:
        import inspect

        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        if "head_dtype" not in inspect.getsource(LogitsProcessor._get_logits):
            Path(job["out"]).write_text(json.dumps({"supported": False}))
            return 0
        extra["hf_overrides"] = {"head_dtype": "float32"}
    import vllm

    eng = VLLMEngine(EngineConfig(model_path=job["path"], gpu_memory_utilization=0.5, enforce_eager=job["eager"],
                                  enable_sleep_mode=False, enable_prefix_caching=False, seed=0,
                                  max_model_len=job["max_len"], extra=extra))
    prompts, responses = job["prompts"], job["responses"]
    out = {"supported": True, "vllm": vllm.__version__, "start_s": eng.start_seconds}
    if responses is None:
        samples = eng.generate_ids(prompts, max_tokens=job["gen_len"], temperature=1.0, ignore_eos=True)
        responses = out["responses"] = [list(s.response_ids) for s in samples]
        out["decode"] = [list(s.logprobs) for s in samples]
    sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=p + r) for p, r in zip(prompts, responses)], sp,
                            use_tqdm=False)
    # prompt_logprobs[i]: {token: Logprob} of token i given the tokens before it (the token itself included)
    out["prefill"] = [[float(o.prompt_logprobs[len(p) + t][tok].logprob) for t, tok in enumerate(r)]
                      for p, r, o in zip(prompts, responses, outs)]
    Path(job["out"]).write_text(json.dumps(out))
    return 0


def _vllm(path: str, prompts, responses, a, fp32_head: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        job = {"path": path, "prompts": prompts, "responses": responses, "gen_len": a.gen_len, "out": f"{d}/out.json",
               "eager": not a.cuda_graphs, "fp32_head": fp32_head, "max_len": a.prompt_max + a.gen_len + 16}
        Path(d, "job.json").write_text(json.dumps(job))
        subprocess.run([sys.executable, "-m", "bench.mismatch", "--vllm-worker", f"{d}/job.json"], check=True,
                       cwd=Path(__file__).resolve().parent.parent)
        return json.loads(Path(d, "out.json").read_text())


@torch.no_grad()
def _hf_sample(model, prompts, n: int, seed: int):
    """CPU stand-in for vLLM: KV-cache decoding one prompt at a time, T=1, raw log-probs."""
    g = torch.Generator().manual_seed(seed)
    responses, logps = [], []
    for p in prompts:
        ids, past, r, lp = torch.tensor([p]), None, [], []
        for _ in range(n):
            o = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, lsm = o.past_key_values, o.logits[0, -1].float().log_softmax(-1)
            r.append(int(torch.multinomial(lsm.exp(), 1, generator=g)))
            lp.append(float(lsm[r[-1]]))
            ids = torch.tensor([[r[-1]]])
        responses.append(r)
        logps.append(lp)
    return responses, logps


# ---------------------------------------------------------------------------------- scoring passes

@torch.no_grad()
def _trainer(model, prompts, responses, dev, wide_dtype, budget: int = 16384) -> dict:
    """The trainer's packed pass (``rlhf.workers.model``: pack → packed_kwargs → base_model →
    logprobs_from_hidden), plus the same hidden states through a wide-dtype head."""
    from rlhf.algos import logprobs_from_hidden
    from rlhf.data.batch import collate
    from rlhf.data.packing import pack, real_lengths, token_groups, unpack
    from rlhf.models.varlen import packed_kwargs

    batch = collate(prompts, responses, pad_id=0)
    B, R = len(prompts), len(responses[0])
    head, V = model.get_output_embeddings(), model.config.vocab_size
    wide = torch.nn.Linear(head.in_features, V, bias=False, device=dev, dtype=wide_dtype)
    wide.weight.copy_(head.weight)
    out = {k: torch.zeros(B, R, dtype=torch.float64) for k in ("trainer", "trainer_wide_head")}
    out["hidden"] = torch.zeros(B, R, head.in_features, dtype=torch.float64)
    plen, rlen = real_lengths(batch)
    for rows in token_groups((plen + rlen).tolist(), budget):
        p = pack(batch, rows)
        h = model.base_model(**packed_kwargs(p, dev)).last_hidden_state[0][p["pred_index"].to(dev)]
        y = p["targets"].to(dev)
        lp, _ = logprobs_from_hidden(h, head, y, 1.0, vocab=V)
        lpw, _ = logprobs_from_hidden(h.to(wide_dtype), wide, y, 1.0, vocab=V)
        out["trainer"][rows] = unpack(lp.double().cpu(), p, len(rows), R)
        out["trainer_wide_head"][rows] = unpack(lpw.double().cpu(), p, len(rows), R)
        out["hidden"][torch.tensor(rows)[p["rows"]], p["cols"]] = h.double().cpu()
    return out


@torch.no_grad()
def _padded(model, prompts, responses, dev, rows: int, with_stats: bool = False) -> dict:
    """Plain HF: left-padded rows (grouped by length), the head on the response positions,
    ``log_softmax`` in float32 or wider; ``layers``: the residual stream after the embedding and
    each layer at the first micro-batch's response positions; ``with_stats``: logit diagnostics."""
    from rlhf.data.batch import collate

    B, R = len(prompts), len(responses[0])
    head = model.get_output_embeddings()
    keys = ("logp", "entropy", "logit_std", "sampled_logit", "max_logit") if with_stats else ("logp",)
    out = {k: torch.zeros(B, R, dtype=torch.float64) for k in keys}
    if with_stats:
        out["hidden"] = torch.zeros(B, R, head.in_features, dtype=torch.float64)
        out["position"] = torch.zeros(B, R, dtype=torch.long)
    order = sorted(range(B), key=lambda i: len(prompts[i]))
    for s in range(0, B, rows):
        idx = order[s:s + rows]
        b = collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id=0)
        o = model.base_model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev),
                             position_ids=b["position_ids"].to(dev), output_hidden_states=s == 0)
        if s == 0:
            out["layers"] = torch.stack([x[:, -R - 1:-1].double().cpu() for x in o.hidden_states])
        h = o.last_hidden_state[:, -R - 1:-1]
        z = head(h)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        lsm = z.log_softmax(-1)
        y = b["input_ids"][:, -R:].to(dev)[..., None]
        out["logp"][idx] = lsm.gather(-1, y)[..., 0].double().cpu()
        if with_stats:
            vals = {"entropy": -(lsm.exp() * lsm).sum(-1), "logit_std": z.std(-1), "hidden": h,
                    "sampled_logit": z.gather(-1, y)[..., 0], "max_logit": z.max(-1).values}
            for k, v in vals.items():
                out[k][idx] = v.to(out[k].dtype).cpu()
            out["position"][idx] = b["position_ids"][:, -R:]
    if not torch.isfinite(out["logp"]).all():
        raise RuntimeError("non-finite log-probs in the padded pass")
    return out


def _stats(d: torch.Tensor) -> dict:
    d = d.abs().flatten()
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max())}


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``|x − ref| / |ref|`` over the last dimension (0 where ref is 0: a zeroed padding-token row)."""
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(torch.finfo(ref.dtype).tiny)


def _bucketed(paths: dict, ref: torch.Tensor, key: torch.Tensor, edges) -> list[dict]:
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (key >= lo) & (key < hi)
        if m.any():
            out.append({"lo": float(lo), "hi": float(hi), "n": int(m.sum()),
                        **{k: float((v - ref)[m].abs().mean()) for k, v in paths.items() if k in KEY_PATHS}})
    return out


def _quartiles(x: torch.Tensor) -> list[float]:
    return [-math.inf, *torch.quantile(x.flatten(), torch.tensor([0.25, 0.5, 0.75], dtype=x.dtype)).tolist(), math.inf]


def measure(preset: str, path: str, a, cpu: bool) -> dict:
    """Every path's log-probs of one sampled batch, compared (module doc)."""
    from transformers import AutoConfig

    import rlhf.models.varlen as varlen
    from rlhf.models.load import load_model

    dev = torch.device("cpu" if cpu else "cuda")
    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(path)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, min(cfg.vocab_size, 32000)) for _ in range(rng.randint(a.prompt_min, a.prompt_max))]
               for _ in range(a.prompts)]
    paths: dict[str, torch.Tensor] = {}
    info: dict = {"preset": preset, "dtype": a.dtype, "ref_dtype": "float64", "prompts": a.prompts,
                  "gen_len": a.gen_len, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                  "vocab": cfg.vocab_size, "tied": bool(cfg.tie_word_embeddings)}
    if not cpu:  # the engines first, each in a child process with the GPU to itself
        v = _vllm(path, prompts, None, a)
        responses, decode = v["responses"], v["decode"]
        paths["engine_prefill"] = torch.tensor(v["prefill"], dtype=torch.float64)
        info["engine"] = f"vllm {v['vllm']} ({'CUDA graphs' if a.cuda_graphs else 'eager'})"
        if a.fp32_head:
            v32 = _vllm(path, prompts, responses, a, fp32_head=True)
            info["engine_fp32_head_supported"] = v32["supported"]
            if v32["supported"]:
                paths["engine_fp32_head"] = torch.tensor(v32["prefill"], dtype=torch.float64)
                # 1.0 would mean the override was ignored (the bf16 head's numbers again)
                same = paths["engine_fp32_head"] == paths["engine_prefill"]
                info["engine_fp32_head_same_as_bf16"] = float(same.double().mean())
    model = load_model(path, "causal_lm", a.dtype).to(dev).eval()
    if cpu:
        responses, decode = _hf_sample(model, prompts, a.gen_len, a.seed)
        info["engine"] = f"hf decode ({a.dtype})"
    info["seconds_engine"] = time.perf_counter() - t0
    paths["engine"] = torch.tensor(decode, dtype=torch.float64)
    varlen.use_varlen(model)
    wide = torch.float64 if cpu else torch.float32
    tr = _trainer(model, prompts, responses, dev, wide)
    paths["trainer"], paths["trainer_wide_head"] = tr["trainer"], tr["trainer_wide_head"]
    kernel, varlen._varlen_kernel = varlen._varlen_kernel, lambda: None
    try:
        paths["trainer_sdpa"] = _trainer(model, prompts, responses, dev, wide)["trainer"]
    finally:
        varlen._varlen_kernel = kernel
    hf = _padded(model, prompts, responses, dev, a.rows)
    paths["hf_padded"] = hf["logp"]
    if not cpu:
        paths["ref32"] = _padded(model.float(), prompts, responses, dev, a.rows)["logp"]
    ref = _padded(model.double(), prompts, responses, dev, a.rows, with_stats=True)
    del model
    C, zy = ref["logp"], ref["sampled_logit"]
    rel = _rel_err(tr["hidden"], ref["hidden"])
    info.update(seconds_total=time.perf_counter() - t0, tokens=C.numel(),
                vs_ref={k: _stats(v - C) for k, v in paths.items()},
                pairs={f"{x}-{y}": _stats(paths[x] - paths[y]) for x, y in PAIRS if x in paths and y in paths})
    info["model"] = {"logit_std": float(ref["logit_std"].mean()), "entropy": float(ref["entropy"].mean()),
                     "sampled_logit_abs": float(zy.abs().mean()), "max_logit": float(ref["max_logit"].mean()),
                     "sampled_logp": float(C.mean()), "hidden_rel_err": float(rel.mean()),
                     "layer_rel_err": [float(_rel_err(x, r).mean()) for x, r in zip(hf["layers"], ref["layers"])]}
    # a float with p significant bits moves z by up to ulp(z)/2 when rounding it: |error| ulp/4 on average
    ulp = torch.exp2(torch.floor(torch.log2(zy.abs().clamp_min(1e-30)))) * torch.finfo(getattr(torch, a.dtype)).eps
    info["predicted"] = {"head_rounding": float((ulp / 4).mean()),
                         "backbone": float((rel * ref["logit_std"]).mean() * math.sqrt(2 / math.pi))}
    info["by_position"] = _bucketed(paths, C, ref["position"], POSITION_EDGES)
    info["by_entropy"] = _bucketed(paths, C, ref["entropy"], _quartiles(ref["entropy"]))
    info["by_sampled_logit"] = _bucketed(paths, C, zy.abs(), _quartiles(zy.abs()))
    return info


def _print(row: dict) -> None:
    m, pr, layers = row["model"], row["predicted"], row["model"]["layer_rel_err"]
    print(f"\n{row['preset']}: {row['tokens']} tokens, engine {row['engine']}, {row['dtype']} vs float64; "
          f"logit std {m['logit_std']:.3f}, entropy {m['entropy']:.2f}, |sampled logit| {m['sampled_logit_abs']:.2f}, "
          f"final hidden rel. err {m['hidden_rel_err']:.2e}; predicted |Δ log p| from head rounding "
          f"{pr['head_rounding']:.3g}, from hidden noise {pr['backbone']:.3g}")
    print("residual stream rel. err after layer (hf_padded): " + " ".join(
        f"{i}:{layers[i]:.2e}" for i in sorted({*range(0, len(layers), 4), len(layers) - 1})))
    print(f"{'|x − y|':<36}{'mean':>10}{'p99':>10}{'max':>10}")
    named = [(f"{k} − ref", v) for k, v in row["vs_ref"].items()] + [(k.replace("-", " − "), v)
                                                                    for k, v in row["pairs"].items()]
    for name, s in named:
        print(f"{name:<36}{s['mean']:>10.3g}{s['p99']:>10.3g}{s['max']:>10.3g}")
    for key in ("by_position", "by_entropy", "by_sampled_logit"):
        print(f"{key}, mean |x − ref|: " + "; ".join(
            f"[{b['lo']:.5g}, {b['hi']:.5g}) n={b['n']} " + " ".join(f"{k}={b[k]:.3g}" for k in KEY_PATHS if k in b)
            for b in row[key]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", help="default qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b (tiny with --cpu-test)")
    ap.add_argument("--cpu-test", action="store_true", help="CPU: HF sampling instead of vLLM, float32 vs float64")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 (float32 on CPU)")
    ap.add_argument("--prompts", type=int, help="default 64 (6 on CPU)")
    ap.add_argument("--gen-len", type=int, help="default 128 (12 on CPU)")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, help="default 768 (40 on CPU)")
    ap.add_argument("--rows", type=int, default=8, help="rows per padded micro-batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", action="store_true", help="vLLM compiled with CUDA graphs, as the RL runs "
                    "have it (default: eager, a faster start)")
    ap.add_argument("--fp32-head", action="store_true", help="also score with a vLLM engine whose LM head is fp32")
    ap.add_argument("--models-dir", default="/tmp/rlhf-gpu/models")
    ap.add_argument("--keep-models", action="store_true")
    ap.add_argument("--out", help="also write the report here (JSON)")
    ap.add_argument("--vllm-worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.vllm_worker:
        return _vllm_worker(a.vllm_worker)
    cpu = a.cpu_test
    if not cpu and not torch.cuda.is_available():
        print("bench.mismatch: no CUDA GPU here; on CPU run it with --cpu-test", file=sys.stderr)
        return 2
    for k, gpu_default, cpu_default in (("presets", "qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b", "tiny"),
                                        ("dtype", "bfloat16", "float32"), ("prompts", 64, 6), ("gen_len", 128, 12),
                                        ("prompt_max", 768, 40)):
        if getattr(a, k) is None:
            setattr(a, k, cpu_default if cpu else gpu_default)
    a.prompt_min = min(a.prompt_min, a.prompt_max)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
    torch.backends.cudnn.allow_tf32 = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still deletes the model dir
    from bench.checks import record, write_json_out
    from bench.common import make_random_model

    report = {"device": "cpu" if cpu else torch.cuda.get_device_name(0), "torch": torch.__version__, "presets": {}}
    for preset in [p for p in a.presets.split(",") if p]:
        path = make_random_model(Path(a.models_dir) / f"{preset}-random", preset)
        try:
            if not cpu:
                gc.collect()
                torch.cuda.empty_cache()  # the engine starts with the GPU free
            row = measure(preset, path, a, cpu)
        finally:
            if not a.keep_models:
                shutil.rmtree(path, ignore_errors=True)
                Path(path + ".lock").unlink(missing_ok=True)
            if not cpu:
                gc.collect()
                torch.cuda.empty_cache()
        report["presets"][preset] = row
        _print(row)
        record(f"mismatch_{preset}", **{k: row[k] for k in ("engine", "tokens", "vs_ref", "pairs", "model")})
        write_json_out("bench_mismatch.json", report)  # after every preset: a 7B timeout keeps the others
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=1))
    print("\nlog-prob mismatch, mean |x − y| (" + ", ".join(report["presets"]) + ")")
    for k in SUMMARY:
        vals = [r["pairs"].get(k, r["vs_ref"].get(k.removesuffix("-ref"))) for r in report["presets"].values()]
        print(f"{k:<38}" + "".join(f"{v['mean']:>10.3g}" if v else f"{'-':>10}" for v in vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
