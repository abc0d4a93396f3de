"""What holds the actor update's MFU at 0.5B: variants of its forward + backward, one table (issue 33 item 4).

    python -m bench.mfu_probe                         # every group, ends before --budget-s (390 s)
    python -m bench.mfu_probe --groups defaults --variants default,tokens_64k

The update as the trainer runs it (``rlhf.workers.model.ModelWorker._token_logprobs``): a random
Qwen2.5-0.5B-shaped model (``bench.make_model`` shapes, bf16), the loop's batch (§4: 256 samples,
32 prompt + 256 response tokens), packed micro-batches of at most ``tokens`` real tokens
(``rlhf.data.packing``: token groups, largest first), ``rlhf_varlen`` attention, log-probs + entropy
from the hidden states (``rlhf.algos.logprobs_from_hidden``), backward of ``Σ logp`` (the entropy a
statistic, as with GRPO's ``algo.entropy_coef=0``; ``--entropy-coef`` adds it to the loss).
FLOPs as ``perf/mfu`` counts them (``rlhf.models.flops``); MFU of ``--peak`` (989, H200 datasheet).

Variants (``VARIANTS``): the GPU defaults (Liger RMSNorm/SwiGLU/RoPE, compiled head, ≤ 32,768 tokens);
16k/64k token budgets; activation checkpointing; Liger's fused linear cross-entropy in the head's place
(no entropy: it has none); ``torch.compile`` of every decoder layer (mode default, then
"max-autotune-no-cudagraphs"), with and without Liger; the defaults through a DeepSpeed ZeRO-2 engine
with the product's optimizer and an optimizer step (what ``perf/mfu`` of the loop times, with
``time/actor_optimizer_step`` apart; ZeRO-1 and 0 beside it); the head alone (product compiled / eager,
with and without entropy, Liger's FLCE) on the defaults' hidden states; the defaults at 1.5B; the head's
logits kept for its backward (the product) against recomputed there (groups ``head_keep``,
``head_keep_15b``); the optimizer step with the fused AdamW's own non-finite skip (the product) against
DeepSpeed's bf16 overflow check (``optimizer_step``). Variants flagged
``profile`` get a torch.profiler breakdown of one update: top CUDA kernels, kernel count, GPU idle
fraction between the first and last kernel, time by kind (matmul, attention, elementwise, ...);
``step_profile`` the same of DeepSpeed's optimizer step alone.

Each group runs in its own process (Liger patches transformers' Qwen2 module globally, so variants
without it run before it is applied; a compile that hangs is killed with its process group), under
the remaining budget; each variant starts only when its estimate fits in what is left. Rows print
as they finish and ``mfu_probe.json`` is rewritten after every group in ``--out`` (``$OUT``), so a
call cut short still returns what ran. On CPU (``--device cpu``, the tests) the same plumbing runs
on a tiny model; layer compilation is skipped there (inductor's C++ build costs minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROW = "MFU_ROW "
AUTOTUNE = "max-autotune-no-cudagraphs"


@dataclass(frozen=True)
class Variant:
    """One configuration of the update. ``est_s``: the seconds it is expected to take at 0.5B on an
    H200 with its warm-up (compilation included), to decide whether it still fits the budget."""

    what: str
    liger: bool = True
    compile_head: bool = True
    layers: Optional[str] = None  # torch.compile mode of every decoder layer; None = eager
    ckpt: bool = False
    head: str = "product"  # product (logits kept for the backward) | product_recompute | liger_flce
    tokens: int = 32768
    deepspeed: bool = False  # a bf16 DeepSpeed engine + the product's optimizer, an optimizer step per update
    zero: int = 2  # its ZeRO stage (CPU: always 0)
    head_only: bool = False  # the head's passes alone on the defaults' hidden states
    preset: Optional[str] = None  # another model shape (the group's model otherwise)
    profile: bool = False
    step_profile: bool = False  # DeepSpeed variants: a torch.profiler breakdown of the optimizer step alone
    # who takes the gradient norm, clips and skips a non-finite step: "optimizer" (the fused AdamW's StepChecks,
    # the product since s24), "deepspeed_norm" (DeepSpeed's norm and clip, the optimizer's skip: s23),
    # "deepspeed" (DeepSpeed's norm, clip and bf16 overflow check: before s23)
    checks: str = "optimizer"
    # the head's passes over a chunk: "product" (rlhf.algos.logprobs' _chunk_stats and _chunk_grad_into), or
    # candidates measured here before they go into the product (below): "fused_grad" (fused_chunk_grad_into),
    # "fused_stats" (fused_chunk_stats), "fused" (both)
    head_passes: str = "product"
    est_s: float = 15.0


VARIANTS: dict[str, Variant] = {
    "default": Variant("GPU defaults: Liger, compiled head, ≤ 32,768 tokens", profile=True, est_s=40),
    "tokens_16k": Variant("defaults, ≤ 16,384 tokens", tokens=16384),
    "tokens_64k": Variant("defaults, ≤ 65,536 tokens", tokens=65536),
    "ckpt": Variant("defaults + activation checkpointing", ckpt=True),
    "liger_flce": Variant("defaults, head = Liger fused linear CE (no entropy)", head="liger_flce", est_s=20),
    "head_only": Variant("head alone: product compiled/eager ± entropy, Liger FLCE", head_only=True, est_s=25),
    "deepspeed": Variant("defaults via DeepSpeed ZeRO-2 + optimizer step (the loop's update)", deepspeed=True,
                         est_s=45),
    "deepspeed_z1": Variant("as deepspeed, ZeRO-1 (no gradient partitioning hooks)", deepspeed=True, zero=1,
                            est_s=35),
    "deepspeed_z0": Variant("as deepspeed, ZeRO-0 (DeepSpeed's bf16 optimizer wrapper)", deepspeed=True, zero=0,
                            est_s=35),
    "no_liger": Variant("compiled head, no Liger", liger=False),
    "layers_compiled": Variant("every decoder layer torch.compile'd (no Liger), compiled head", liger=False,
                               layers="default", profile=True, est_s=100),
    "layers_compiled_64k": Variant("compiled layers (no Liger), ≤ 65,536 tokens", liger=False, layers="default",
                                   tokens=65536, est_s=30),
    "layers_compiled_liger": Variant("compiled layers + Liger, compiled head", layers="default", est_s=80),
    "layers_autotune": Variant(f"compiled layers, mode {AUTOTUNE} (no Liger)", liger=False, layers=AUTOTUNE,
                               est_s=200),
    "default_15b": Variant("GPU defaults at 1.5B, ≤ 32,768 tokens", preset="qwen2.5-1.5b", est_s=70),
    # the head's logits kept for its backward (the product since the twenty-third session) against
    # recomputed in the backward (before it), with compiled layers (the loop's GPU default)
    "layers_compiled_recompute": Variant("compiled layers, the head recomputing its logits in the backward",
                                         liger=False, layers="default", head="product_recompute", est_s=30),
    "head_only_no_liger": Variant("head alone, no Liger: kept / recomputed logits, compiled / eager",
                                  liger=False, head_only=True, est_s=25),
    "deepspeed_z1_compiled": Variant("compiled layers via DeepSpeed ZeRO-1 + optimizer step (the loop's update)",
                                     liger=False, layers="default", deepspeed=True, zero=1, step_profile=True,
                                     est_s=60),
    "deepspeed_z1_compiled_15b_16k": Variant("compiled layers via DeepSpeed ZeRO-1 + optimizer step at 1.5B, "
                                             "≤ 16,384 tokens (the loop's update there)", liger=False,
                                             layers="default", deepspeed=True, zero=1, tokens=16384,
                                             preset="qwen2.5-1.5b", profile=True, est_s=90),
    "deepspeed_z1_compiled_fused_grad": Variant("the loop's update, the head's backward as one pointwise pass "
                                                "(fused_chunk_grad_into)", liger=False, layers="default",
                                                deepspeed=True, zero=1, profile=True, head_passes="fused_grad",
                                                est_s=45),
    "deepspeed_z1_compiled_fused_stats": Variant("the loop's update, the head's forward statistics without a log "
                                                 "per logit (fused_chunk_stats)", liger=False, layers="default",
                                                 deepspeed=True, zero=1, profile=True, head_passes="fused_stats",
                                                 est_s=45),
    "deepspeed_z1_compiled_fused_head": Variant("the loop's update, both candidate head passes", liger=False,
                                                layers="default", deepspeed=True, zero=1, profile=True,
                                                head_passes="fused", est_s=45),
    "deepspeed_z1_compiled_15b_16k_fused_head": Variant("both candidate head passes at 1.5B, ≤ 16,384 tokens",
                                                        liger=False, layers="default", deepspeed=True, zero=1,
                                                        tokens=16384, preset="qwen2.5-1.5b", head_passes="fused",
                                                        est_s=60),
    "deepspeed_z1_compiled_check": Variant("the same with DeepSpeed's norm, clip, bf16 overflow check (before s23)",
                                           liger=False, layers="default", deepspeed=True, zero=1,
                                           step_profile=True, checks="deepspeed", est_s=30),
    "deepspeed_z1_compiled_ds_norm": Variant("the same with DeepSpeed's norm and clip, the optimizer's skip (s23)",
                                             liger=False, layers="default", deepspeed=True, zero=1,
                                             step_profile=True, checks="deepspeed_norm", est_s=30),
    "layers_compiled_15b_16k": Variant("compiled layers at 1.5B, ≤ 16,384 tokens (the loop's budget there)",
                                       liger=False, layers="default", tokens=16384, preset="qwen2.5-1.5b",
                                       est_s=80),
    "layers_compiled_15b_16k_recompute": Variant("the same, the head recomputing its logits",
                                                 liger=False, layers="default", tokens=16384,
                                                 preset="qwen2.5-1.5b", head="product_recompute", est_s=30),
}

# (group, variants, seconds its process may take at most): one process each, in this order; the
# no-Liger variants of a group come before its first Liger one (Liger's patches are process-wide)
GROUPS: list[tuple[str, list[str], float]] = [
    ("defaults", ["default", "tokens_16k", "tokens_64k", "head_only", "liger_flce", "ckpt", "deepspeed"], 170),
    ("compiled_layers", ["layers_compiled", "layers_compiled_64k", "no_liger", "layers_compiled_liger"], 170),
    ("size_15b", ["default_15b"], 110),
    ("zero_stages", ["deepspeed_z1", "deepspeed_z0"], 90),
    ("autotune", ["layers_autotune"], 250),
    ("head_keep", ["layers_compiled", "layers_compiled_recompute", "head_only_no_liger", "deepspeed_z1_compiled"],
     230),
    ("head_keep_15b", ["layers_compiled_15b_16k", "layers_compiled_15b_16k_recompute"], 170),
    ("optimizer_step", ["deepspeed_z1_compiled", "deepspeed_z1_compiled_ds_norm", "deepspeed_z1_compiled_check"],
     230),
    # where the GPU waits in the loop's update (profiles with their idle stretches), both sizes
    ("update_gaps", ["deepspeed_z1_compiled", "deepspeed_z1_compiled_15b_16k"], 250),
    # the head's passes as the product runs them against the candidates, both sizes, one process
    ("head_passes", ["deepspeed_z1_compiled", "deepspeed_z1_compiled_fused_grad", "deepspeed_z1_compiled_fused_stats",
                     "deepspeed_z1_compiled_fused_head", "deepspeed_z1_compiled_15b_16k",
                     "deepspeed_z1_compiled_15b_16k_fused_head"], 400),
]
START_S = 12.0  # a fresh process: imports and CUDA start-up, before its first variant


# --------------------------------------------------------------------------- the workload


def loop_batch(samples: int, prompt: int, response: int, response_min: int, vocab: int, seed: int = 0):
    """A padded batch shaped like the §4 loop's: ``samples`` rows of ``prompt`` tokens and responses of
    ``response_min``–``response`` tokens (the random model never samples EOS, so the loop's are full)."""
    from rlhf.data.batch import collate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (prompt,), generator=g).tolist() for _ in range(samples)]
    lens = torch.randint(response_min, response + 1, (samples,), generator=g).tolist()
    resps = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    return collate(prompts, resps, pad_id=0, response_width=response)


def micro_batches(batch, tokens: int) -> list[dict]:
    """The packed micro-batches the trainer makes of ``batch`` (one rank): token groups, largest first."""
    from rlhf.data.packing import largest_first, pack, real_lengths, token_groups

    plen, rlen = real_lengths(batch)
    n = (plen + rlen).tolist()
    return [pack(batch, rows) for rows in largest_first(token_groups(n, tokens), n)]


def counted_flops(shape, micro: list[dict]) -> float:
    """Forward + backward model FLOPs of the micro-batches, as ``perf/mfu`` counts them."""
    return sum(3 * shape.forward(float(p["input_ids"].numel()), float(len(p["targets"])), float(p["sq_lengths"]))
               for p in micro)


# --------------------------------------------------------------------------- one variant


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def load(path: str, v: Variant, device: str):
    """The model as ``ModelWorker.load`` makes it (+ the variant's layer compilation); returns
    ``(model, notes)``. DeepSpeed variants load float32 (the engine keeps float32 master weights)."""
    from rlhf.models.load import apply_liger, load_model
    from rlhf.models.varlen import use_varlen

    notes: list[str] = []
    dtype = "float32" if v.deepspeed or device == "cpu" else "bfloat16"
    m = load_model(path, "causal_lm", dtype)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    if v.liger and device == "cuda" and _liger_installed():
        apply_liger(m, required=False)
    elif v.liger:
        notes.append("Liger not applied (" + ("CPU run" if device != "cuda" else "liger-kernel not installed") + ")")
    use_varlen(m)
    if v.ckpt:
        m.gradient_checkpointing_enable()
    m = m.to(device).train()
    if v.layers:
        from torch import _dynamo

        # one graph should serve every layer (their parameters are its inputs); if guards on each
        # layer made a graph per layer, the default cache limit (8) would leave the rest eager
        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
        _dynamo.config.accumulated_cache_size_limit = max(_dynamo.config.accumulated_cache_size_limit, 512)
        kw: dict[str, Any] = {"mode": None if v.layers == "default" else v.layers}
        if device != "cuda":  # the plumbing and dynamo's tracing only: inductor's C++ build takes minutes on 2 cores
            kw = {"backend": "aot_eager"}
            notes.append("CPU: layers compiled with backend aot_eager (tracing only, no inductor)")
        for layer in m.model.layers:
            layer.compile(dynamic=True, **kw)
    return m, notes


def flce_head(weight: torch.Tensor):
    """Liger's fused linear cross-entropy as a log-prob head: ``logp = -CE`` per token (no entropy)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    ce = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def head(hidden, targets):
        return -ce(weight, hidden, targets), None
    return head


def product_head(model, compile: bool, with_entropy: bool = True, keep: bool = True):
    """The product's head; ``keep=False``: its logits recomputed in the backward (``keep_elements=0``)."""
    from rlhf.algos import logprobs_from_hidden

    head, vocab = model.get_output_embeddings(), model.config.vocab_size

    def run(hidden, targets):
        return logprobs_from_hidden(hidden, head, targets, 1.0, with_entropy, vocab=vocab, compile=compile,
                                    keep_elements=None if keep else 0)
    return run


def head_of(model, v: Variant, device: str):
    if v.head == "liger_flce":
        if device != "cuda" or not _liger_installed():
            return None
        return flce_head(model.get_output_embeddings().weight)
    return product_head(model, v.compile_head and device == "cuda", keep=v.head != "product_recompute")


def loss_of(lp: torch.Tensor, ent: Optional[torch.Tensor], entropy_coef: float) -> torch.Tensor:
    """``Σ logp`` (+ ``entropy_coef · Σ H``): with the GRPO default ``algo.entropy_coef=0`` the entropy is a
    statistic only, and the head's backward skips its term, as in the product."""
    return lp.sum() if ent is None or entropy_coef == 0 else lp.sum() + entropy_coef * ent.sum()


def update(model, micro: list[dict], head, device: str, engine=None, entropy_coef: float = 0.0,
           last_step: bool = True) -> float:
    """One update (every micro-batch's forward + backward; with ``engine`` DeepSpeed's backward and its
    step at the boundary, as ``PolicyWorker.update``); returns the optimizer step's seconds.
    ``last_step=False`` stops before the boundary's step (``step_profile`` takes it)."""
    from rlhf.models.varlen import packed_kwargs

    opt_s = 0.0
    for i, p in enumerate(micro):
        hidden = model.base_model(**packed_kwargs(p, device)).last_hidden_state[0][p["pred_index"].to(device)]
        lp, ent = head(hidden, p["targets"].to(device))
        loss = loss_of(lp, ent, entropy_coef)
        if engine is None:
            loss.backward()
            continue
        last = i == len(micro) - 1
        engine.set_gradient_accumulation_boundary(last)
        engine.backward(loss, scale_wrt_gas=False)
        if last and not last_step:
            break
        if last:
            _sync(device)
            t = time.perf_counter()
        engine.step()
        if last:
            _sync(device)
            opt_s = time.perf_counter() - t
    return opt_s


def _deepspeed(model, n_micro: int, device: str, zero: int = 2, checks: str = "optimizer"):
    """The actor's engine as ``TrainedWorker._initialize`` builds it: the product's DeepSpeed config
    (bf16, ZeRO ``zero`` on a GPU) and optimizer (torch's fused AdamW, at ZeRO-1/2 taking the norm,
    clipping and skipping a non-finite step itself); ``checks`` (``Variant.checks``) gives DeepSpeed
    those jobs back as the product did before."""
    from types import SimpleNamespace

    import deepspeed

    from rlhf.workers.model import ds_config
    from rlhf.workers.trained import _optimizer

    if not torch.distributed.is_initialized():
        from rlhf.workers.base import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        for k, val in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, val)
        if device != "cuda":
            from rlhf.workers.base import skip_deepspeed_shm_build

            skip_deepspeed_shm_build()
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    spec = SimpleNamespace(
        device=device,
        batch=SimpleNamespace(micro_batch_size=1, grad_accum=n_micro),
        train=SimpleNamespace(zero_stage=zero if device == "cuda" else 0, offload_optimizer=False),
        model=SimpleNamespace(dtype="bfloat16" if device == "cuda" else "float32"),
        algo=SimpleNamespace(weight_decay=0.0, max_grad_norm=1.0))
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = ds_config(spec, 0, 1.0, 1)
    if checks == "optimizer":
        opt = _optimizer(spec, params, 1e-6)
    else:
        from rlhf.workers.trained import StepChecks

        opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=device == "cuda")
        cfg["gradient_clipping"] = 1.0
        cfg["zero_optimization"].pop("compute_grad_norm", None)
        if checks == "deepspeed":
            cfg["bf16"]["check_grad_overflow"] = True
        else:  # the twenty-third session's: the optimizer's norm for its skip alone, no clipping
            opt.register_step_pre_hook(StepChecks(0.0))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def run_variant(name: str, path: str, a, device: str, deadline: float) -> dict[str, Any]:
    """One row: warm-up update (compilation included), then up to ``a.repeats`` timed updates (fewer when
    the deadline nears; the median counts), model TFLOP/s and MFU, peak memory, graph breaks."""
    from rlhf.models.flops import flop_shape

    v = VARIANTS[name]
    row: dict[str, Any] = {"variant": name, "what": v.what, "tokens_budget": max(1, int(v.tokens * a.tokens_scale))}
    if v.liger and device == "cuda" and not _liger_installed():
        return {**row, "skipped": "liger-kernel not installed"}
    if device == "cuda":
        gc.collect()  # an earlier variant's DeepSpeed engine holds reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["held_at_start_gib"] = torch.cuda.memory_allocated() / 2**30  # inside peak_gib: what is left over
    t_load = time.perf_counter()
    model, notes = load(path, v, device)
    batch = loop_batch(a.samples, a.prompt, a.response, a.response_min or a.response, model.config.vocab_size)
    micro = micro_batches(batch, max(1, int(v.tokens * a.tokens_scale)))
    shape = flop_shape(model)
    flops = counted_flops(shape, micro)
    engine = _deepspeed(model, len(micro), device, v.zero, v.checks) if v.deepspeed else None
    fwd_model = engine.module if engine is not None else model
    row.update(micro_batch_tokens=[int(p["input_ids"].numel()) for p in micro],
               predicted_tokens=sum(len(p["targets"]) for p in micro), flops=flops,
               load_s=round(time.perf_counter() - t_load, 2))
    if notes:
        row["notes"] = notes
    if v.head_only:
        row.update(head_rows(fwd_model, micro, device, a, deadline))
    else:
        head = head_of(fwd_model, v, device)
        if head is None:
            return {**row, "skipped": "Liger's fused linear CE needs CUDA and liger-kernel"}
        _dynamo_reset_counters()
        t = time.perf_counter()
        update(fwd_model, micro, head, device, engine, a.entropy_coef)  # warm-up: compilation, Triton autotuning
        _sync(device)
        row["warmup_s"] = round(time.perf_counter() - t, 2)
        row.update(_dynamo_counts())
        times, opt = [], []
        for _ in range(a.repeats):
            if times and time.time() + 1.5 * max(times) > deadline:
                break
            if engine is None:
                model.zero_grad(set_to_none=True)
            _sync(device)
            t = time.perf_counter()
            opt.append(update(fwd_model, micro, head, device, engine, a.entropy_coef))
            _sync(device)
            times.append(time.perf_counter() - t)
        s = sorted(times)[len(times) // 2]
        row.update(s=s, repeats=len(times), tflops=flops / s / 1e12, mfu=flops / s / 1e12 / a.peak)
        if engine is not None:
            o = sorted(opt)[len(opt) // 2]
            row.update(optimizer_s=o, fwd_bwd_mfu=flops / max(s - o, 1e-9) / 1e12 / a.peak)
        wants = v.profile if a.profile is None else name in a.profile.split(",")
        if wants and time.time() + 3 * s + 10 < deadline:
            row["profile"] = profile_update(
                lambda: update(fwd_model, micro, head, device, engine, a.entropy_coef), device, a.top_kernels)
        if engine is not None and v.step_profile and time.time() + 2 * s + 10 < deadline:
            update(fwd_model, micro, head, device, engine, a.entropy_coef, last_step=False)
            _sync(device)
            row["step_profile"] = profile_update(engine.step, device, a.top_kernels)
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del engine, model, fwd_model
    return row


def head_rows(model, micro: list[dict], device: str, a, deadline: float) -> dict[str, Any]:
    """The LM head's forward + backward alone on the largest micro-batch's hidden states (detached, the
    backbone not rerun): seconds per call and the share of the defaults' head FLOPs rate."""
    from rlhf.models.varlen import packed_kwargs

    p = micro[0]
    with torch.no_grad():
        hidden = model.base_model(**packed_kwargs(p, device)).last_hidden_state[0][p["pred_index"].to(device)]
    targets = p["targets"].to(device)
    heads = {"product_compiled": product_head(model, device == "cuda"),
             "product_compiled_recomputed": product_head(model, device == "cuda", keep=False),
             "product_compiled_no_entropy": product_head(model, device == "cuda", with_entropy=False),
             "product_eager": product_head(model, False),
             "product_eager_recomputed": product_head(model, False, keep=False)}
    if device == "cuda" and _liger_installed():
        heads["liger_flce_no_entropy"] = flce_head(model.get_output_embeddings().weight)
    M, V, h = hidden.shape[0], model.config.vocab_size, model.config.hidden_size
    flops = 3 * 2.0 * M * V * h
    out: dict[str, Any] = {"head_tokens": M, "head_flops": flops, "heads": {}}
    for name, head in heads.items():
        if time.time() + 10 > deadline:
            out["heads"][name] = {"skipped": "budget"}
            continue
        times = []
        for k in range(1 + a.repeats):  # the first call compiles
            x = hidden.detach().requires_grad_()
            model.zero_grad(set_to_none=True)
            _sync(device)
            t = time.perf_counter()
            lp, ent = head(x, targets)
            loss_of(lp, ent, a.entropy_coef).backward()
            _sync(device)
            if k:
                times.append(time.perf_counter() - t)
        s = sorted(times)[len(times) // 2]
        out["heads"][name] = {"s": s, "tflops": flops / s / 1e12, "mfu": flops / s / 1e12 / a.peak}
    return out


def _dynamo_reset_counters() -> None:
    try:
        from torch._dynamo.utils import counters

        counters.clear()
    except Exception:  # noqa: BLE001  (a torch without dynamo: nothing to count)
        pass


def _dynamo_counts() -> dict[str, Any]:
    """Graph breaks (and their most frequent reasons) and graphs compiled during the warm-up."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    breaks = counters.get("graph_break", {})
    if not breaks and not counters.get("stats"):
        return {}
    top = sorted(breaks.items(), key=lambda kv: -kv[1])[:4]
    return {"graph_breaks": int(sum(breaks.values())), "graph_break_reasons": [(str(k)[:160], n) for k, n in top],
            "graphs": int(counters.get("stats", {}).get("unique_graphs", 0))}


# --------------------------------------------------------------------------- the profile


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name (cuBLAS/CUTLASS matmuls, FlashAttention, Triton/ATen elementwise
    and reductions, copies)."""
    n = name.lower()
    if any(k in n for k in ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "addmm", "aten::mm",
                            "aten::bmm", "triton_tem_fused")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attn", "attention")):
        return "attention"
    if n.startswith(("triton_red_", "triton_per_")):  # inductor's reductions (persistent ones too)
        return "reduction"
    if n.startswith("triton_poi_"):  # inductor's pointwise kernels, whatever ops they fused
        return "elementwise/other"
    if any(k in n for k in ("memcpy", "memset", "copy_kernel", "aten::copy", "aten::to")):
        return "copy"
    if any(k in n for k in ("reduce", "sum", "norm", "softmax", "logsumexp", "red_")):
        return "reduction"
    return "elementwise/other"


def busy_union(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """``(busy, span)``: the length of the union of ``[start, end)`` intervals, and from the first
    start to the last end (the kernels' wall window: span − busy is the GPU's idle time in it)."""
    if not intervals:
        return 0.0, 0.0
    iv = sorted(intervals)
    busy, (cs, ce) = 0.0, iv[0]
    for s, e in iv[1:]:
        if s > ce:
            busy += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    return busy, max(e for _, e in iv) - iv[0][0]


def profile_update(fn, device: str, top: int = 15) -> dict[str, Any]:
    """torch.profiler over one ``fn()``: on CUDA the kernels (count, time by kind, top ``top`` by time,
    kernels under 10 µs, GPU idle fraction in the kernels' window); on CPU the operators by self time
    (what the plumbing can show without a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    evs = prof.events()
    if device == "cuda":
        from torch.autograd import DeviceType

        kernels = [e for e in evs if e.device_type == DeviceType.CUDA]
        dur = [(e.name, e.time_range.elapsed_us()) for e in kernels]
        busy, span = busy_union([(e.time_range.start, e.time_range.end) for e in kernels])
    else:
        leaf = [e for e in evs if not e.cpu_children]
        dur = [(e.name, e.time_range.elapsed_us()) for e in leaf]
        busy, span = None, None
    total = sum(d for _, d in dur) or 1.0
    by_name: dict[str, list[float]] = {}
    kinds: dict[str, float] = {}
    for n, d in dur:
        by_name.setdefault(n, [0, 0.0])
        by_name[n][0] += 1
        by_name[n][1] += d
        kinds[kernel_kind(n)] = kinds.get(kernel_kind(n), 0.0) + d
    small = [d for _, d in dur if d < 10.0]
    out: dict[str, Any] = {
        "kernels": len(dur), "kernel_ms": round(total / 1e3, 2),
        "share_by_kind": {k: round(t / total, 3) for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels_under_10us": len(small), "kernels_under_10us_ms": round(sum(small) / 1e3, 2),
        "top": [{"name": n[:90], "calls": c, "ms": round(t / 1e3, 2), "share": round(t / total, 3)}
                for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }
    if busy is not None and span:
        out.update(window_ms=round(span / 1e3, 2), gpu_idle_fraction=round(1 - busy / span, 3))
        out["gaps"] = idle_gaps([(e.time_range.start, e.time_range.end, e.name) for e in kernels])
    return out


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 12, min_us: float = 100.0) -> dict[str, Any]:
    """Where the GPU waits in a profile: the ``top`` longest stretches of ``min_us`` or more with no kernel
    running, each with its offset from the first kernel (ms), its length (ms) and the kernels either side;
    and the idle time in all such stretches. ``kernels``: (start µs, end µs, name)."""
    iv = sorted(kernels)
    if not iv:
        return {"count": 0, "ms": 0.0, "top": []}
    t0, end, before = iv[0][0], iv[0][1], iv[0][2]
    gaps = []
    for s, e, name in iv[1:]:
        if s - end >= min_us:
            gaps.append({"at_ms": round((end - t0) / 1e3, 2), "ms": round((s - end) / 1e3, 3),
                         "after": before[:60], "before": name[:60]})
        if e > end:
            end, before = e, name
    return {"count": len(gaps), "ms": round(sum(g["ms"] for g in gaps), 2),
            "top": sorted(gaps, key=lambda g: -g["ms"])[:top]}


# --------------------------------------------------------------------------- processes


def child(a) -> int:
    """One group's variants in this process; a row per variant on stdout (``MFU_ROW {json}``)."""
    device = a.device
    deadline = a.deadline
    for name in a.variants.split(","):
        v = VARIANTS[name]
        left = deadline - time.time()
        if left < v.est_s * a.est_scale:
            row = {"variant": name, "what": v.what, "skipped": f"budget: {left:.0f} s left, needs ~{v.est_s:.0f} s"}
        else:
            path = a.model or _model_path(v.preset or a.preset)
            try:
                with head_passes(v.head_passes):
                    row = run_variant(name, path, a, device, deadline)
            except Exception as e:  # noqa: BLE001  (one variant failing must not lose the others)
                row = {"variant": name, "what": v.what, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                if device == "cuda":
                    torch.cuda.empty_cache()
        print(ROW + json.dumps(row, default=str), flush=True)
    return 0


def fused_chunk_grad_into(logits, tokens, lse, ez, g, e, tau: float) -> None:
    """``rlhf.algos.logprobs._chunk_grad_into``'s gradient, ``(-p (g + e (z - E_p[z])) + onehot(y) g) / tau``,
    as one pointwise expression (the one-hot term a ``torch.where`` on the column index, added in float32
    before rounding) stored with one ``copy_``: on CPU's inductor this compiles to a single kernel writing
    the chunk in place, where the product's gather / pass / scatter leaves a buffer copied back into the
    chunk on the GPU (BENCHMARKS §12, twenty-fourth session). Eagerly it holds float32 temporaries the
    size of the chunk (the product's eager pass works in place)."""
    z = logits.to(lse.dtype)
    if tau != 1.0:
        z = z / tau
    p = (z - lse[:, None]).exp()
    inner = g[:, None] if e is None else g[:, None] + e[:, None] * (z - ez[:, None])
    target = torch.arange(logits.shape[1], device=logits.device)[None, :] == tokens[:, None]
    dz = torch.where(target, g[:, None], 0.0) - p * inner
    if tau != 1.0:
        dz = dz / tau
    logits.copy_(dz.to(logits.dtype))


def fused_chunk_stats(logits: torch.Tensor, tokens: torch.Tensor, tau: float, with_entropy: bool):
    """``rlhf.algos.logprobs._chunk_stats``' ``(logp, lse, E_p[z])`` with ``E_p[z] = Σ q z / Σ q`` (``q = exp(z −
    max)``): no log per logit (the product's ``q log q`` takes one), written for torch.compile (it keeps ``z``
    and ``q`` together, which the product's eager pass avoids by working in place)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if tau != 1.0:
        z = z / tau
    m = z.amax(-1, keepdim=True)
    q = (z - m).exp()
    s = q.sum(-1)
    lse = s.log() + m.squeeze(1)
    z_y = z.gather(1, tokens[:, None]).squeeze(1)
    ez = (q * z).sum(-1) / s if with_entropy else None
    return z_y - lse, lse, ez


@contextlib.contextmanager
def head_passes(which: str):
    """The head's passes for one variant (``Variant.head_passes``), the product's put back after."""
    from rlhf.algos import logprobs

    swap = {"product": {}, "fused_grad": {"_chunk_grad_into": fused_chunk_grad_into},
            "fused_stats": {"_chunk_stats": fused_chunk_stats},
            "fused": {"_chunk_grad_into": fused_chunk_grad_into, "_chunk_stats": fused_chunk_stats}}[which]
    product = {name: getattr(logprobs, name) for name in swap}
    for name, fn in swap.items():
        setattr(logprobs, name, fn)
    try:
        yield
    finally:
        for name, fn in product.items():
            setattr(logprobs, name, fn)


def _model_path(preset: str) -> str:
    from bench.common import make_random_model

    return make_random_model(f"/tmp/rlhf-gpu/models/{preset}-random", preset)


def parse_rows(text: str) -> list[dict]:
    return [json.loads(line[len(ROW):]) for line in text.splitlines() if line.startswith(ROW)]


def run_group(group: str, names: list[str], cap_s: float, a, deadline: float, out: Path) -> list[dict]:
    """``names`` in a child process, killed (with its compile workers: its own process group) at the
    earlier of ``cap_s`` and the deadline; the rows it printed by then."""
    end = min(deadline, time.time() + cap_s)
    log = out / f"mfu_probe_{group}.log"
    cmd = [sys.executable, "-m", "bench.mfu_probe", "--child", "--variants", ",".join(names),
           "--deadline", str(end - 3), "--device", a.device, "--preset", a.preset, "--samples", str(a.samples),
           "--prompt", str(a.prompt), "--response", str(a.response), "--response-min", str(a.response_min),
           "--repeats", str(a.repeats), "--entropy-coef", str(a.entropy_coef), "--peak", str(a.peak),
           "--est-scale", str(a.est_scale),
           "--top-kernels", str(a.top_kernels), "--tokens-scale", str(a.tokens_scale)]
    cmd += (["--profile", a.profile] if a.profile is not None else []) + (["--model", a.model] if a.model else [])
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=str(Path(__file__).resolve().parent.parent))
        try:
            rc = p.wait(timeout=max(1.0, end - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "killed at its time limit"
    text = log.read_text()
    rows = parse_rows(text)
    done = {r["variant"] for r in rows}
    for n in names:
        if n not in done:
            rows.append({"variant": n, "what": VARIANTS[n].what,
                         "error": f"group {group} ended (rc {rc}) before it: see {log.name}"})
    for r in rows:
        r["group"] = group
    if rc not in (0,):
        rows[-1].setdefault("tail", text[-1500:])
    print(f"--- group {group}: rc {rc}, {time.time() - t0:.0f} s, {len(done)} of {len(names)} variants", flush=True)
    return rows


def table(rows: list[dict], peak: float) -> str:
    base = next((r["s"] for r in rows if r["variant"] == "default" and "s" in r), None)
    lines = [f"| variant | what | tokens/micro-batch | s / update | TFLOP/s | MFU of {peak:.0f} | vs default | "
             "peak GiB | warm-up s | notes |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mb = "/".join(str(t) for t in r.get("micro_batch_tokens", []))
        if "s" in r:
            extra = []
            if "optimizer_s" in r:
                extra.append(f"optimizer {r['optimizer_s']:.3f} s, fwd+bwd MFU {r['fwd_bwd_mfu']:.1%}")
            if r.get("graph_breaks"):
                extra.append(f"{r['graph_breaks']} graph breaks")
            extra += r.get("notes", [])
            lines.append(f"| {r['variant']} | {r['what']} | {mb} | {r['s']:.3f} | {r['tflops']:.0f} | {r['mfu']:.1%} | "
                         f"{base / r['s'] if base else float('nan'):.2f} | {r.get('peak_gib', 0):.1f} | "
                         f"{r.get('warmup_s', 0):.1f} | {'; '.join(extra)} |")
        elif "heads" in r:
            for hn, h in r["heads"].items():
                val = (f"{h['s']:.4f} | {h['tflops']:.0f} | {h['mfu']:.1%}" if "s" in h
                       else f"– | – | {h['skipped']}")
                lines.append(f"| head_only/{hn} | LM head alone, {r['head_tokens']} predicted tokens | {mb} | {val} | "
                             f"– | – | – | |")
        else:
            lines.append(f"| {r['variant']} | {r['what']} | {mb} | – | – | – | – | – | – | "
                         f"{r.get('skipped') or r.get('error', '')} |")
    for r, which, prof in ((r, w, r.get(k)) for r in rows for k, w in (("profile", "profile"),
                                                                       ("step_profile", "optimizer step"))):
        if not prof:
            continue
        lines.append(f"\n{which} of {r['variant']}: {prof['kernels']} kernels, {prof['kernel_ms']} ms of kernels"
                     + (f" in a {prof['window_ms']} ms window, GPU idle {prof['gpu_idle_fraction']:.1%}"
                        if "window_ms" in prof else "")
                     + f"; {prof['kernels_under_10us']} kernels < 10 µs ({prof['kernels_under_10us_ms']} ms); by kind "
                     + ", ".join(f"{k} {v:.1%}" for k, v in prof["share_by_kind"].items()))
        for t in prof["top"]:
            lines.append(f"  {t['ms']:9.2f} ms {t['share']:6.1%} {t['calls']:6d}×  {t['name']}")
        gaps = prof.get("gaps")
        if gaps:
            lines.append(f"  GPU idle stretches ≥ 0.1 ms: {gaps['count']}, {gaps['ms']} ms; the longest:")
            for g in gaps["top"]:
                lines.append(f"    at {g['at_ms']:9.2f} ms  {g['ms']:7.3f} ms  after {g['after']}  "
                             f"before {g['before']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None, help="a checkpoint instead of the preset's random model (tests)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--response-min", type=int, default=0, help="shortest response (0 = --response: all full)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--entropy-coef", type=float, default=0.0,
                    help="the loss's entropy weight (algo.entropy_coef; 0 = GRPO's default: entropy a statistic)")
    ap.add_argument("--peak", type=float, default=989.0)
    # under scripts/gpu.sh: end 15 s before the job's own timeout
    job = float(os.environ.get("JOB_TIMEOUT_S", 0)) - 15
    ap.add_argument("--budget-s", type=float, default=min(390.0, job) if job > 0 else 390.0)
    ap.add_argument("--groups", default=",".join(g for g, _, _ in GROUPS))
    ap.add_argument("--variants", default="", help="only these variants (of the chosen groups; child: its list)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/rlhf-gpu/out")
    ap.add_argument("--est-scale", type=float, default=1.0, help="× every variant's time estimate")
    ap.add_argument("--top-kernels", type=int, default=15)
    ap.add_argument("--tokens-scale", type=float, default=1.0,
                    help="× every variant's token budget (tests: tiny batches)")
    ap.add_argument("--profile", default=None, help="variants to profile (default: default, layers_compiled)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.child:
        return child(a)
    deadline = time.time() + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {v.strip() for v in a.variants.split(",") if v.strip()}
    unknown = only - set(VARIANTS)
    groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    bad = set(groups) - {g for g, _, _ in GROUPS}
    if unknown or bad:
        raise SystemExit(f"mfu_probe: unknown variant(s) {sorted(unknown)} / group(s) {sorted(bad)}; variants: "
                         f"{', '.join(VARIANTS)}; groups: {', '.join(g for g, _, _ in GROUPS)}")
    rows: list[dict] = []
    meta = {"preset": a.preset, "samples": a.samples, "prompt": a.prompt, "response": a.response,
            "response_min": a.response_min or a.response, "peak_tflops": a.peak, "budget_s": a.budget_s,
            "device": a.device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None}
    for group, names, cap in GROUPS:
        if group not in groups:
            continue
        names = [n for n in names if not only or n in only]
        if not names:
            continue
        left = deadline - time.time()
        need = START_S * a.est_scale + min(VARIANTS[n].est_s for n in names) * a.est_scale
        if left < need:
            rows += [{"variant": n, "what": VARIANTS[n].what, "group": group,
                      "skipped": f"budget: {left:.0f} s left for the group"} for n in names]
            continue
        rows += run_group(group, names, cap, a, deadline, out)
        (out / "mfu_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (out / "mfu_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if os.environ.get("RLHF_GPU_OUT"):  # scripts/gpu.sh gathers bench_*.json into its bench.json
        Path(os.environ["RLHF_GPU_OUT"], "bench_mfu_probe.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, default=str))
    print(f"actor update MFU probe, {a.preset}, {a.samples} samples × ({a.prompt} + "
          f"{a.response_min or a.response}–{a.response}) tokens, {a.device}")
    print(table(rows, a.peak))
    print(f"wrote {out / 'mfu_probe.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
