"""Where the generation phase's time goes, and what each lever buys (issue 33, item 2).

One call, one GPU, one table. The work is the RL loop's generation phase of the issue's acceptance
line: ``--prompts`` 32 prompts × ``--group`` 8 samples × ``--gen-len`` 512 tokens (``ignore_eos``,
so every row does the same 131,072 tokens), prompts of ``--prompt-len`` 32 random token ids,
temperature 1, sampled-token log-probs on (``logprobs_mode=processed_logprobs``), unseeded (vLLM's
``rollout.seeded`` default). Every row goes through the product's own path:
``rlhf.rollout.generate.generate(engines, prompt_ids, Sampling)`` → ``VLLMEngine.generate`` in Ray
actors → ``Sample`` objects back to the driver, which is what ``time/generate`` measures in the loop.

Engines (each a ``VLLMEngine`` Ray actor, engine core in the actor process unless said; every one
with the product's ``EngineConfig`` and ``RLHF_VLLM_ARGS``, sleep mode and prefix caching on, a fixed
KV cache ``kv_cache_memory_bytes`` so that several start side by side without vLLM's memory
profiling seeing each other): ``product`` ×4 (the 2- and 4-engine rows use copies of it; a fifth for
the kernel trace), and one
each of ``async_off`` (``async_scheduling=False``), ``graphs_default`` (vLLM's own capture sizes, no
``cudagraph_capture_sizes``), ``seqs_256`` (``max_num_seqs=256, max_num_batched_tokens=8192``),
``v1_runner`` (``VLLM_USE_V2_MODEL_RUNNER=0``) and ``mp_core`` (``EngineConfig.multiprocessing``:
the engine core in a child process, vLLM's default layout, as a standalone ``LLM`` has it).

Rows (``LEVERS``, run in this order, so that a call short of time loses the least likely wins):
``baseline`` (alone on the GPU, before the other engines start); ``engines_2`` and ``engines_4`` (the
prompts split by ``rlhf.rollout.generate.launch`` over engines sharing the GPU, each its own
process); ``combo`` (the faster multi-engine row with flat log-probs); ``flat_logprobs``
(``SamplingParams(flat_logprobs=True)``); ``logprobs_off``; ``seeded`` (a seed per prompt, as
``rollout.seeded=true``); one row per engine variant; ``baseline_again`` (drift). Per row, median of
``--reps`` calls after a short warm-up:

* completion tokens/s and the ratio to ``baseline``;
* where a call's wall time goes: ``LLM.generate`` inside the actor vs the rest (``Sample`` objects,
  Ray, the driver);
* per model step (in-process engines: timers wrapped around vLLM 0.26's ``EngineCore`` methods,
  ``StepTimers``): ms per step, and the host's ms in ``schedule``, ``execute_model`` (input prep +
  launch), ``sample_tokens``, waiting for the GPU (``future.result``), ``update_from_output`` and the
  front end's ``process_outputs``;
* GPU busy %: NVML ``utilization.gpu`` sampled in a thread during the timed calls (coarse); and one
  ``--trace-tokens`` call of the baseline's kind under ``torch.profiler`` (CUDA activity only), on a
  spare copy of the product's engine that is then shut down, gives the exact busy fraction of the
  kernel span and GPU ms per model step (``kernel_busy``);
* log-prob agreement: mean |vLLM − trainer| log-prob of ``--keep`` samples of the row, the trainer's
  side computed as ``bench.mismatch`` does (the product's packed bf16 pass), after the engines are
  gone; the ratio to the baseline's says whether a lever moved the mismatch off the bf16 level.

    python -m bench.gen_levers --preset qwen2.5-0.5b      # on the GPU (scripts/gpu.sh gen-levers)
    python -m bench.gen_levers --plan                     # the rows and engine settings; no GPU

vLLM API (0.26.0 wheel, checked in its source): ``async_scheduling`` is an ``EngineArgs`` field
(vllm/engine/arg_utils.py; ``SchedulerConfig.async_scheduling``, vllm/config/scheduler.py) whose
default ``None`` becomes True when the executor supports it (vllm/config/vllm.py, the uniprocess
executor does: vllm/v1/executor/uniproc_executor.py), so the product already runs with it and the
row measures it *off*; ``EngineCore.step_with_batch_queue`` is the overlapped step
(vllm/v1/engine/core.py). ``kv_cache_memory_bytes`` skips memory profiling
(vllm/v1/worker/gpu_worker.py ``determine_available_memory``); the free-memory check at start still
compares with ``gpu_memory_utilization`` (vllm/v1/worker/utils.py ``request_memory``).
``SamplingParams.flat_logprobs`` and ``detokenize`` (vllm/sampling_params.py); the product already
passes ``detokenize=False`` and ``skip_tokenizer_init=True``, so detokenisation is off in every row.
Dense Qwen2 runs vLLM's V2 model runner by default (``VllmConfig.use_v2_model_runner``,
vllm/config/vllm.py; env ``VLLM_USE_V2_MODEL_RUNNER``), whose sampler draws every request from its
own seed with Gumbel noise (vllm/v1/worker/gpu/sample/sampler.py, gumbel.py): the ``seeded`` row
checks that seeds now cost nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

GiB = 1 << 30
# scripts/gpu.sh's RLHF_VLLM_ARGS: the CUDA-graph sizes of the framework's runs
GPU_SH_VLLM_ARGS = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}}


# ----------------------------------------------------------------------------- what runs


@dataclass(frozen=True)
class EngineVariant:
    """One engine's settings over the product's: ``config`` EngineConfig fields, ``extra`` more
    ``vllm.LLM`` arguments, ``drop`` keys removed from the product's extras, ``env`` the actor's
    environment."""

    name: str
    what: str
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    in_process: bool = True  # the engine core in the actor: the step timers can reach it


VARIANTS = {
    v.name: v for v in (
        EngineVariant("product", "the product's engine (RLHF_VLLM_ARGS, async scheduling at vLLM's default)"),
        # vllm/config/scheduler.py SchedulerConfig.async_scheduling; vllm/engine/arg_utils.py EngineArgs
        EngineVariant("async_off", "async_scheduling=False", extra={"async_scheduling": False}),
        EngineVariant("graphs_default", "vLLM's own CUDA-graph sizes (1,2,4,8..248 by 8, 256..512 by 16)",
                      drop=("compilation_config",)),
        EngineVariant("seqs_256", "max_num_seqs=256, max_num_batched_tokens=8192 (vLLM's H200 default: 1024, 16384)",
                      config={"max_num_seqs": 256, "max_num_batched_tokens": 8192}),
        # vllm/envs.py VLLM_USE_V2_MODEL_RUNNER; vllm/config/vllm.py use_v2_model_runner
        EngineVariant("v1_runner", "vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)",
                      env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        EngineVariant("mp_core", "engine core in a child process (EngineConfig.multiprocessing, vLLM's default layout)",
                      config={"multiprocessing": True}, in_process=False),
    )
}


@dataclass(frozen=True)
class Lever:
    """One row: which engines (variant names; several = the prompts split between them), the
    per-call options (``seeded``; ``logprobs``; ``flat``: SamplingParams.flat_logprobs)."""

    name: str
    what: str
    engines: tuple[str, ...] = ("product",)
    seeded: bool = False
    logprobs: bool = True
    flat: bool = False


LEVERS = (
    Lever("baseline", "the RL loop's call until the fourteenth session: 1 engine, unseeded, sampled-token "
                      "log-probs nested (a Logprob per token)"),
    Lever("engines_2", "2 engines on the GPU, prompts split (rlhf.rollout.generate.launch)", engines=("product",) * 2),
    Lever("engines_4", "4 engines on the GPU, prompts split", engines=("product",) * 4),
    Lever("combo", "the faster of engines_2/engines_4, with flat log-probs", engines=("product",) * 4, flat=True),
    Lever("flat_logprobs", "SamplingParams(flat_logprobs=True): no Logprob object per token", flat=True),
    Lever("logprobs_off", "no log-probs (the trainer would recompute them)", logprobs=False),
    Lever("seeded", "a seed per prompt (rollout.seeded=true)", seeded=True),
    Lever("async_off", "async scheduling off (the product has it on: vLLM's default)", engines=("async_off",)),
    Lever("mp_core", "engine core in its own process", engines=("mp_core",)),
    Lever("graphs_default", "vLLM's default CUDA-graph capture sizes", engines=("graphs_default",)),
    Lever("seqs_256", "max_num_seqs 256, max_num_batched_tokens 8192", engines=("seqs_256",)),
    Lever("v1_runner", "vLLM's V1 model runner", engines=("v1_runner",)),
    Lever("baseline_again", "baseline once more (drift over the call)"),
)


def select_levers(names: Optional[str]) -> list[Lever]:
    """The rows to run, in ``LEVERS`` order; ``names``: comma-separated, None = all."""
    if not names:
        return list(LEVERS)
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = {lv.name for lv in LEVERS}
    bad = [n for n in want if n not in known]
    if bad:
        raise SystemExit(f"bench.gen_levers: unknown lever(s) {bad}; choose from {sorted(known)}")
    if "baseline" not in want:
        want.insert(0, "baseline")  # every ratio is to it
    return [lv for lv in LEVERS if lv.name in want]


def engines_needed(levers: Sequence[Lever]) -> dict[str, int]:
    """How many engines of each variant the rows use at once (the product's copies are shared)."""
    need: dict[str, int] = {}
    for lv in levers:
        for v in set(lv.engines):
            need[v] = max(need.get(v, 0), lv.engines.count(v))
    return need


def engine_shares(n_prompts: int, n_engines: int) -> list[tuple[int, int]]:
    """The contiguous prompt ranges ``rlhf.rollout.generate.launch`` gives each engine (the last
    ones may get fewer, an engine with none is not called)."""
    per = math.ceil(n_prompts / n_engines)
    return [(e * per, min(n_prompts, (e + 1) * per)) for e in range(n_engines) if e * per < n_prompts]


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, sequences: int, seq_len: int,
                   dtype_bytes: int = 2, headroom: float = 1.5) -> int:
    """KV cache for ``sequences`` of ``seq_len`` tokens (K and V of every layer), with headroom,
    rounded up to whole GiB and at least 2 GiB."""
    need = 2 * layers * kv_heads * head_dim * dtype_bytes * sequences * seq_len * headroom
    return max(2, math.ceil(need / GiB)) * GiB


def seeds_for(n_prompts: int, seed: int = 0, step: int = 0) -> tuple[int, ...]:
    """``rlhf.rollout.generate.sampling_for``'s seeds (seeded runs): one per prompt."""
    return tuple(seed * 1_000_000_007 + step * 100_003 + i for i in range(n_prompts))


# ----------------------------------------------------------------------------- measuring


class StepTimers:
    """Seconds and calls of methods wrapped in place (an instance attribute over the bound method),
    for vLLM's engine-core step parts. ``wrap(obj, "schedule", "schedule", count=pred)`` also counts
    the calls whose result satisfies ``pred`` (model steps); ``futures=True`` times the ``result()``
    of what the method returns (waiting for the GPU)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.steps = 0
        self.wrapped: list[str] = []
        self.missing: list[str] = []

    def reset(self) -> None:
        self.seconds = {k: 0.0 for k in self.seconds}
        self.calls = {k: 0 for k in self.calls}
        self.steps = 0

    def _add(self, key: str, dt: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt
        self.calls[key] = self.calls.get(key, 0) + 1

    def wrap(self, obj: Any, attr: str, key: str, count: Optional[Callable[[Any], bool]] = None,
             futures: bool = False) -> bool:
        fn = getattr(obj, attr, None) if obj is not None else None
        if not callable(fn):
            self.missing.append(key)
            return False
        self.seconds.setdefault(key, 0.0)
        self.calls.setdefault(key, 0)
        clock, timers = self.clock, self

        def timed(*a, **kw):
            t0 = clock()
            try:
                out = fn(*a, **kw)
            finally:
                timers._add(key, clock() - t0)
            if count is not None and count(out):
                timers.steps += 1
            if futures and out is not None and callable(getattr(out, "result", None)):
                timers._wrap_result(out, "wait_gpu")
            return out

        setattr(obj, attr, timed)
        self.wrapped.append(key)
        return True

    def _wrap_result(self, fut: Any, key: str) -> None:
        res, clock, timers = fut.result, self.clock, self
        self.seconds.setdefault(key, 0.0)
        self.calls.setdefault(key, 0)

        def result(*a, **kw):
            t0 = clock()
            try:
                return res(*a, **kw)
            finally:
                timers._add(key, clock() - t0)

        try:
            fut.result = result
        except AttributeError:  # a slotted future: its waits stay inside the step's other parts
            pass

    def read(self) -> dict:
        return {"steps": self.steps, "seconds": dict(self.seconds), "calls": dict(self.calls),
                "missing": list(self.missing)}


def per_step_ms(timer_reads: Sequence[dict], wall_s: Sequence[float]) -> dict:
    """Per model step, averaged over the engines of a call: ``step`` (``LLM.generate`` wall / steps)
    and each timed part in ms. ``wall_s``: each engine's ``LLM.generate`` seconds."""
    out: dict[str, list[float]] = {}
    counted = []
    for rd, wall in zip(timer_reads, wall_s):
        # engine core in another process: no scheduler here; the front end's output batches instead
        steps = rd.get("steps", 0) or rd.get("calls", {}).get("process_outputs", 0)
        if not steps:
            continue
        counted.append(steps)
        out.setdefault("step", []).append(1e3 * wall / steps)
        for k, s in rd.get("seconds", {}).items():
            out.setdefault(k, []).append(1e3 * s / steps)
    res = {k: statistics.fmean(v) for k, v in out.items() if k != "llm_generate"}
    if counted:
        res["steps"] = statistics.fmean(counted)
    return res


class Sampler:
    """Reads ``read()`` (a percentage) every ``interval`` seconds in a thread between ``start`` and
    ``stop``; ``stop`` returns the mean (None without readings)."""

    def __init__(self, read: Callable[[], Optional[float]], interval: float = 0.05) -> None:
        self.read_fn, self.interval = read, interval
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                v = self.read_fn()
            except Exception:  # noqa: BLE001 - a failed reading is a missing one
                v = None
            if v is not None:
                self.values.append(float(v))
            self._stop.wait(self.interval)

    def start(self) -> "Sampler":
        self.values, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Optional[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return statistics.fmean(self.values) if self.values else None


def nvml_util_reader(index: int = 0) -> Optional[Callable[[], float]]:
    """NVML's ``utilization.gpu`` of GPU ``index`` (percent of the last sample period with a
    kernel running): pynvml (vLLM's dependency), else ``nvidia-smi``; None without either."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
    except Exception:  # noqa: BLE001 - try the command line
        pass
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    cmd = ["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    return lambda: float(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip())


def kernel_busy(intervals: Sequence[tuple[float, float]]) -> dict:
    """GPU kernels' (start, end) times in µs: their count, the span from the first start to the
    last end, the time covered by at least one kernel (overlaps counted once) and its fraction."""
    if not intervals:
        return {"kernels": 0, "span_s": 0.0, "busy_s": 0.0, "busy": None}
    ivs = sorted(intervals)
    busy, cur_s, cur_e = 0.0, ivs[0][0], ivs[0][1]
    for s, e in ivs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in ivs) - ivs[0][0]
    return {"kernels": len(ivs), "span_s": span / 1e6, "busy_s": busy / 1e6, "busy": busy / span if span > 0 else None}


def mismatch_stats(engine: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> dict:
    """Mean and max |engine − trainer| over every token (rows of equal length in both)."""
    diffs = [abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t, strict=True)]
    if not diffs:
        return {"mean": None, "max": None, "tokens": 0}
    return {"mean": statistics.fmean(diffs), "max": max(diffs), "tokens": len(diffs)}


def summarize(name: str, runs: Sequence[dict], work_tokens: int) -> dict:
    """One row from its timed runs: medians of the call's wall, of ``LLM.generate`` (slowest engine)
    and of GPU busy %; per-step figures of the median run."""
    walls = [r["wall_s"] for r in runs]
    med = statistics.median(walls)
    mid = min(runs, key=lambda r: abs(r["wall_s"] - med))
    busy = [r["gpu_busy"] for r in runs if r.get("gpu_busy") is not None]
    engine_s = [max(r["llm_generate_s"]) for r in runs if r.get("llm_generate_s")]
    return {"lever": name, "runs_s": walls, "median_s": med, "tok_per_s": work_tokens / med,
            "llm_generate_s": statistics.median(engine_s) if engine_s else None,
            "gpu_busy": statistics.median(busy) if busy else None, "per_step_ms": mid.get("per_step_ms", {})}


STEP_PARTS = (("schedule", "sched"), ("execute_model", "exec"), ("sample_tokens", "sample"),
              ("wait_gpu", "wait"), ("update_from_output", "update"), ("process_outputs", "out"))


def format_table(rows: Sequence[dict], header: str) -> str:
    """The report: one line per row, ratios to the row named ``baseline``."""
    base = next((r for r in rows if r["lever"] == "baseline" and r.get("median_s")), None)
    base_mm = (base or {}).get("mismatch", {}).get("mean")

    def f(v, spec, dash="-"):
        return format(v, spec) if isinstance(v, (int, float)) and v is not None else dash

    cols = ["lever", "eng", "tok/s", "vs base", "call s", "LLM.gen s", "rest s", "steps", "ms/step",
            *[short for _, short in STEP_PARTS], "GPU %", "|dlogp|", "vs base"]
    widths = [16, 4, 9, 8, 8, 10, 7, 6, 8, *[7] * len(STEP_PARTS), 6, 9, 8]
    lines = [header, "".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['lever']:<16}  skipped: {r['skipped']}")
            continue
        ps = r.get("per_step_ms", {})
        gen = r.get("llm_generate_s")
        rest = r["median_s"] - gen if gen is not None else None
        mm = r.get("mismatch", {}).get("mean")
        cells = [r["lever"], f(r.get("engines"), "d"), f(r["tok_per_s"], ".0f"),
                 f(base["median_s"] / r["median_s"] if base else None, ".3f"), f(r["median_s"], ".3f"),
                 f(gen, ".3f"), f(rest, ".3f"), f(ps.get("steps"), ".0f"), f(ps.get("step"), ".2f"),
                 *[f(ps.get(k), ".2f") for k, _ in STEP_PARTS], f(r.get("gpu_busy"), ".0f"),
                 f(mm, ".5f"), f(mm / base_mm if mm is not None and base_mm else None, ".2f")]
        lines.append("".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per call (the loop's prompts_per_step)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (algo.group_size)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per row (median)")
    ap.add_argument("--warm-tokens", type=int, default=16, help="tokens of each row's warm-up call")
    ap.add_argument("--levers", default=None, help="comma-separated rows (default: all; baseline always)")
    ap.add_argument("--util", type=float, default=0.06,
                    help="gpu_memory_utilization of each engine (only vLLM's free-memory check at start: "
                         "the KV cache is --kv-gib)")
    ap.add_argument("--kv-gib", type=float, default=0, help="KV cache per engine (0: what the work needs x1.5)")
    ap.add_argument("--keep", type=int, default=64, help="samples per row scored by the trainer for the mismatch")
    ap.add_argument("--trace-tokens", type=int, default=64,
                    help="tokens of one call under torch.profiler, on a spare copy of the product's engine "
                         "(0: none)")
    ap.add_argument("--start-timeout", type=float, default=240, help="seconds for the engines after the first to start")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for everything (default: JOB_TIMEOUT_S less 20, else 540)")
    ap.add_argument("--models-dir", default="/tmp/rlhf-gpu/models")
    ap.add_argument("--plan", action="store_true", help="print the rows and engine settings; start nothing")
    a = ap.parse_args(argv)
    if a.budget_s is None:
        a.budget_s = float(os.environ["JOB_TIMEOUT_S"]) - 20 if os.environ.get("JOB_TIMEOUT_S") else 540.0
    if a.prompts < 1 or a.group < 1 or a.gen_len < 1 or a.reps < 1:
        ap.error("--prompts, --group, --gen-len and --reps must be >= 1")
    a.lever_list = select_levers(a.levers)
    return a


def product_extra() -> dict:
    """The ``vllm.LLM`` extras of the framework's GPU runs: ``RLHF_VLLM_ARGS`` (as
    ``rlhf.rollout.vllm.engine_config`` reads it), else scripts/gpu.sh's value."""
    raw = os.environ.get("RLHF_VLLM_ARGS")
    return json.loads(raw) if raw else json.loads(json.dumps(GPU_SH_VLLM_ARGS))


def engine_config_dict(variant: EngineVariant, model: str, a: argparse.Namespace, kv_bytes: int) -> dict:
    """``EngineConfig`` fields of one engine: the product's (``rlhf.rollout.vllm.engine_config`` of a
    hybrid run: sleep mode on, seed 0, bf16) with the variant's changes and the fixed KV cache."""
    extra = {k: v for k, v in product_extra().items() if k not in variant.drop}
    extra.update(variant.extra)
    extra["kv_cache_memory_bytes"] = int(kv_bytes)  # vllm/config/cache.py CacheConfig.kv_cache_memory_bytes
    cfg = dict(model_path=model, tensor_parallel=1, dtype="bfloat16", seed=0, gpu_memory_utilization=a.util,
               enforce_eager=False, enable_sleep_mode=True, max_model_len=a.prompt_len + a.gen_len + 16,
               extra=extra)
    cfg.update(variant.config)
    return cfg


def engines_text(engines: dict) -> str:
    """What vLLM resolved for each engine variant (its first engine), one line each."""
    lines = ["engines as vLLM resolved them (start s; async scheduling; V2 model runner; max_num_seqs; "
             "max_num_batched_tokens; CUDA-graph mode and largest captured size):"]
    for name, infos in engines.items():
        ok = [i for i in infos if "error" not in i]
        bad = [i["error"] for i in infos if "error" in i]
        if ok:
            i = ok[0]
            sizes = i.get("capture_sizes") or []
            starts = ", ".join(f"{x.get('start_s', 0):.0f}" for x in ok)
            lines.append(f"  {name:<15}x{len(ok)}  start {starts} s; "
                         f"async {i.get('async_scheduling')}; v2 {i.get('v2_model_runner')}; "
                         f"seqs {i.get('max_num_seqs')}; tokens {i.get('max_num_batched_tokens')}; "
                         f"{i.get('cudagraph_mode')} <= {max(sizes) if sizes else '-'} ({len(sizes)} sizes)"
                         + (f"; timers missing: {i['timers_missing']}" if i.get("timers_missing") else "")
                         + (f"; {i['settings_error']}" if i.get("settings_error") else ""))
        for e in bad:
            lines.append(f"  {name:<15}not started: {e}")
    return "\n".join(lines)


def trace_text(trace: Optional[dict]) -> str:
    """The kernel trace's line under the table."""
    if not trace:
        return "baseline kernel trace: not run"
    if "error" in trace:
        return f"baseline kernel trace: failed ({trace['error']})"
    steps = trace.get("steps") or 0
    busy = trace.get("busy")
    return (f"baseline kernel trace ({steps} model steps, {trace['kernels']} kernels, call {trace['wall_s']:.3f} s): "
            f"GPU busy {'-' if busy is None else f'{100 * busy:.1f}'} % of the {trace['span_s']:.3f} s kernel span; "
            + (f"GPU {1e3 * trace['busy_s'] / steps:.2f} ms and wall {1e3 * trace['wall_s'] / steps:.2f} ms per step"
               if steps else "no step count"))


def plan_text(a: argparse.Namespace, kv_bytes: Optional[int] = None) -> str:
    need = engines_needed(a.lever_list)
    lines = [f"gen_levers, {a.preset}: {a.prompts} prompts x {a.group} samples x {a.gen_len} tokens "
             f"(prompt {a.prompt_len} tokens), {a.reps} timed calls per row"]
    lines.append("engines: " + ", ".join(f"{k} x{v}" for k, v in need.items()) +
                 (f" (+1 product for the kernel trace, {a.trace_tokens} tokens)" if a.trace_tokens else "") +
                 (f"; KV cache {kv_bytes / GiB:.0f} GiB each" if kv_bytes else ""))
    for k in need:
        v = VARIANTS[k]
        lines.append(f"  {k:<15}{v.what}")
    lines.append("rows:")
    for lv in a.lever_list:
        split = " + ".join(f"{hi - lo}" for lo, hi in engine_shares(a.prompts, len(lv.engines)))
        lines.append(f"  {lv.name:<15}{lv.what} [prompts per engine: {split}]")
    lines.append(f"product vLLM extras: {json.dumps(product_extra())}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.plan:
        print(plan_text(a))
        return 0
    return run(a)


def run(a: argparse.Namespace) -> int:  # pragma: no cover - needs the GPU and vLLM
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from bench.checks import record, write_json_out
    from bench.common import SAFE_ENV, fixed_len_prompts, make_random_model

    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    import ray
    import torch

    from rlhf.rollout.engine import Sampling
    from rlhf.rollout.generate import generate

    model = make_random_model(os.path.join(a.models_dir, f"{a.preset}-random"), a.preset)
    from transformers import AutoConfig

    hc = AutoConfig.from_pretrained(model)
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    samples = a.prompts * a.group
    kv = int(a.kv_gib * GiB) if a.kv_gib else kv_cache_bytes(hc.num_hidden_layers, hc.num_key_value_heads,
                                                              head_dim, samples, a.prompt_len + a.gen_len)
    print(plan_text(a, kv), flush=True)
    prompts = fixed_len_prompts(a.prompts, a.prompt_len, vocab=min(2048, hc.vocab_size), seed=0)
    work = samples * a.gen_len
    report: dict[str, Any] = {"preset": a.preset, "prompts": a.prompts, "group": a.group, "prompt_len": a.prompt_len,
                              "gen_len": a.gen_len, "work_tokens": work, "kv_cache_gib": kv / GiB,
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "engines": {}, "rows": []}
    header = (f"\ngeneration levers, {a.preset}-shaped random model, {a.prompts} prompts x {a.group} x {a.gen_len} "
              f"tokens (ignore_eos, T=1), median of {a.reps}; ms per model step and its host parts "
              f"(in-process engines); GPU % = NVML utilization; |dlogp| = mean |vLLM - trainer| of {a.keep} samples")

    def save() -> None:
        write_json_out(f"bench_gen_levers_{a.preset}.json", report)

    ray.init(num_gpus=1, num_cpus=os.cpu_count() or 8, include_dashboard=False,
             runtime_env={"env_vars": dict(SAFE_ENV)})
    from bench.gen_engine import BenchEngine
    from rlhf.rollout.vllm import EngineConfig

    need = engines_needed(a.lever_list)
    rows_product = need.get("product", 1)
    if a.trace_tokens:  # a copy of the product's engine no row uses: the profiler touches nothing measured
        need["product"] = rows_product + 1
    share = round(0.9 / sum(need.values()), 3)  # Ray's GPU share per actor; all of them fit
    actors: dict[str, list] = {}

    def spawn(name: str):
        v = VARIANTS[name]
        cfg = EngineConfig(**engine_config_dict(v, model, a, kv))
        env = {**SAFE_ENV, **v.env}
        return ray.remote(BenchEngine).options(num_gpus=share, num_cpus=0,
                                               runtime_env={"env_vars": env}).remote(cfg)

    rows: list[dict] = report["rows"]

    def on_term(*_):  # gpu.sh's timeout: the rows measured so far still make a table
        print(format_table(rows, header + " [cut short]"), flush=True)
        print(engines_text(report["engines"]), flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    reader = nvml_util_reader(0)
    kept: dict[str, tuple[list, list, list]] = {}

    def call(engs: list, lv: Lever, tokens: int, timed: bool) -> dict:
        ray.get([e.set_options.remote(flat=lv.flat, logprobs=lv.logprobs) for e in engs])
        sampling = Sampling(n=a.group, max_new_tokens=tokens, temperature=1.0,
                            seeds=seeds_for(a.prompts) if lv.seeded else ())
        if timed:
            ray.get([e.timers_reset.remote() for e in engs])
        gpu = Sampler(reader).start() if (timed and reader) else None
        t0 = time.perf_counter()
        out = generate(engs, prompts, sampling)
        wall = time.perf_counter() - t0
        busy = gpu.stop() if gpu else None
        got = sum(len(s.response_ids) for s in out)
        if got != samples * tokens:
            raise RuntimeError(f"{lv.name}: {got} tokens, expected {samples * tokens}")
        res: dict[str, Any] = {"wall_s": wall, "gpu_busy": busy}
        if timed:
            reads = ray.get([e.timers_read.remote() for e in engs])
            gens = [r["seconds"].get("llm_generate", 0.0) for r in reads]
            res.update(llm_generate_s=gens, per_step_ms=per_step_ms(reads, gens), timers=reads)
            if lv.logprobs:
                keep = out[: a.keep]
                kept[lv.name] = ([prompts[s.prompt_index] for s in keep], [list(s.response_ids) for s in keep],
                                 [list(s.logprobs) for s in keep])
        return res

    def measure(lv: Lever, engs: list, est: Optional[float]) -> None:
        if est is not None and time.perf_counter() + est > deadline - 45:
            rows.append({"lever": lv.name, "what": lv.what, "skipped": f"no time (needs ~{est:.0f} s)"})
            print(f"[gen_levers] {lv.name}: skipped, no time", flush=True)
            return
        try:
            call(engs, lv, a.warm_tokens, timed=False)
            runs = [call(engs, lv, a.gen_len, timed=True) for _ in range(a.reps)]
        except Exception as e:  # noqa: BLE001 - one lever failing leaves the others
            rows.append({"lever": lv.name, "what": lv.what, "skipped": f"failed: {e!r}"[:300]})
            print(f"[gen_levers] {lv.name}: FAILED {e!r}", flush=True)
            return
        row = summarize(lv.name, runs, work)
        row.update(what=lv.what, engines=len(engs), variant=lv.engines[0], seeded=lv.seeded, logprobs=lv.logprobs,
                   flat=lv.flat, timers=runs[-1].get("timers"))
        rows.append(row)
        record(f"gen_levers_{a.preset}_{lv.name}", **{k: v for k, v in row.items() if k != "timers"})
        save()
        print(f"[gen_levers] {lv.name}: {row['tok_per_s']:.0f} tok/s, median {row['median_s']:.3f} s "
              f"(runs {', '.join(f'{x:.2f}' for x in row['runs_s'])}), GPU busy {row['gpu_busy']}", flush=True)

    try:
        # the first engine alone: it compiles (vLLM's torch.compile cache), the others then read that cache
        t0 = time.perf_counter()
        actors["product"] = [spawn("product")]
        ray.get(actors["product"][0].ready.remote())
        report["engines"]["product"] = [ray.get(actors["product"][0].vllm_settings.remote())]
        print(f"[gen_levers] first engine up in {time.perf_counter() - t0:.0f} s: {report['engines']['product'][0]}",
              flush=True)

        # the baseline first, alone on the GPU; then every other engine at once, on the warm compile cache
        measure(a.lever_list[0], actors["product"], None)
        base_s: Optional[float] = rows[-1].get("median_s") if rows else None
        est = None if base_s is None else base_s * (a.reps + 0.5) * 1.3 + 3  # a row's seconds, generously
        pending = {}
        for name, count in need.items():
            for _ in range(count - len(actors.get(name, []))):
                h = spawn(name)
                actors.setdefault(name, []).append(h)
                pending[h.ready.remote()] = (name, h)
        t0 = time.perf_counter()
        start_deadline = min(t0 + a.start_timeout, deadline - 90)
        ready, _ = ray.wait(list(pending), num_returns=len(pending),
                            timeout=max(1.0, start_deadline - time.perf_counter())) if pending else ([], [])
        failed: list[str] = []
        for ref, (name, h) in pending.items():
            ok = ref in ready
            if ok:
                try:
                    ray.get(ref)
                    report["engines"].setdefault(name, []).append(ray.get(h.vllm_settings.remote()))
                except Exception as e:  # noqa: BLE001 - its rows say "engine not started"
                    ok = False
                    report["engines"].setdefault(name, []).append({"error": repr(e)[:300]})
            else:
                report["engines"].setdefault(name, []).append({"error": "not up in time"})
            if not ok:  # only engines that answered stay in the pools
                failed.append(name)
                actors[name].remove(h)
                ray.kill(h)
        print(f"[gen_levers] {len(pending) - len(failed)} more engines up in {time.perf_counter() - t0:.0f} s"
              + (f"; not up: {sorted(failed)}" if failed else ""), flush=True)

        # the product's kernels under torch.profiler, on its spare copy: GPU busy exactly, GPU ms per step
        spare = actors.get("product", [])[rows_product:]
        if a.trace_tokens and spare:
            try:
                ray.get(spare[0].generate.remote(prompts, Sampling(n=a.group, max_new_tokens=a.warm_tokens)),
                        timeout=60)  # its first call: lazily compiled kernels
                ref = spare[0].kernel_trace.remote(
                    prompts, Sampling(n=a.group, max_new_tokens=a.trace_tokens, temperature=1.0))
                report["kernel_trace"] = ray.get(ref, timeout=60)
            except Exception as e:  # noqa: BLE001 - the table stands without it
                report["kernel_trace"] = {"error": repr(e)[:300]}
            print(f"[gen_levers] kernel trace: {report['kernel_trace']}", flush=True)
            for h in spare:  # its memory back before the timed rows
                actors["product"].remove(h)
                ray.kill(h)

        def engines_for(lv: Lever) -> Optional[list]:
            out, used = [], {}
            for v in lv.engines:
                i = used.get(v, 0)
                pool = actors.get(v, [])
                if i >= len(pool):
                    return None
                out.append(pool[i])
                used[v] = i + 1
            return out

        for lv in a.lever_list[1:]:  # LEVERS order: the likeliest wins first, in case time runs out
            if lv.name == "combo":  # the faster multi-engine row, with flat log-probs
                multi = [r for r in rows if r["lever"] in ("engines_2", "engines_4") and r.get("median_s")]
                if not multi:
                    rows.append({"lever": lv.name, "what": lv.what, "skipped": "no multi-engine row measured"})
                    continue
                best = min(multi, key=lambda r: r["median_s"])
                lv = Lever("combo", f"{best['lever']} + flat log-probs", engines=("product",) * best["engines"],
                           flat=True)
            engs = engines_for(lv)
            if engs is None:
                rows.append({"lever": lv.name, "what": lv.what, "skipped": "engine not started"})
                continue
            measure(lv, engs, est)

    finally:
        ray.shutdown()  # the engines go: the GPU is the trainer pass's
        save()

    # the log-prob agreement: the product's packed bf16 trainer pass (bench.mismatch) over each row's samples
    if kept and time.perf_counter() < deadline - 20:
        try:
            import gc

            import rlhf.models.varlen as varlen
            from bench.mismatch import _trainer
            from rlhf.models.load import load_model

            gc.collect()
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            tm = load_model(model, "causal_lm", "bfloat16").to(dev).eval()
            varlen.use_varlen(tm)
            for r in rows:
                if r["lever"] not in kept or time.perf_counter() > deadline - 10:
                    continue
                ps, rs, lps = kept[r["lever"]]
                tr = _trainer(tm, ps, rs, dev, torch.float32)["trainer"]
                r["mismatch"] = mismatch_stats(lps, tr.tolist())
            del tm
        except Exception as e:  # noqa: BLE001 - the speed table stands without it
            report["mismatch_error"] = repr(e)[:300]
            print(f"[gen_levers] mismatch pass failed: {e!r}", flush=True)
    report["seconds"] = time.perf_counter() - t_start
    save()
    record(f"gen_levers_{a.preset}", rows=[{k: v for k, v in r.items() if k != "timers"} for r in rows],
           engines=report["engines"], kv_cache_gib=report["kv_cache_gib"])
    print(format_table(rows, header), flush=True)
    print(engines_text(report["engines"]), flush=True)
    print(trace_text(report.get("kernel_trace")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
