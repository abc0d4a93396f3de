"""bench.gen_levers on CPU: the rows and engines it plans, the prompt split it measures (against
the product's ``rlhf.rollout.generate.launch``), the KV-cache size, the step timers and the GPU-busy
sampler, the table, and its engine (``bench.gen_engine``) against a stand-in ``vllm`` module shaped
like vLLM 0.26's in-process engine core. The GPU run itself is scripts/gpu.sh's ``gen-levers``."""

from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass

import pytest

from bench import gen_levers as gl


def test_rows_and_engines():
    names = [lv.name for lv in gl.select_levers(None)]
    assert names[0] == "baseline" and names[-1] == "baseline_again" and len(names) == len(set(names))
    # baseline is always measured: every ratio is to it
    assert [lv.name for lv in gl.select_levers("async_off, engines_2")] == ["baseline", "engines_2", "async_off"]
    with pytest.raises(SystemExit, match="unknown lever"):
        gl.select_levers("baseline,warp_drive")
    need = gl.engines_needed(gl.select_levers(None))
    assert need["product"] == 4 and all(need[v] == 1 for v in gl.VARIANTS if v != "product")
    assert gl.engines_needed(gl.select_levers("seeded")) == {"product": 1}
    assert set(gl.engines_needed(gl.select_levers(None))) == set(gl.VARIANTS)


class _Remote:
    def __init__(self, calls, e):
        self.calls, self.e = calls, e

    def remote(self, prompts, sampling):
        self.calls.append((self.e, prompts, sampling))
        return f"ref{self.e}"


@pytest.mark.parametrize("n,k", [(32, 1), (32, 2), (32, 4), (30, 4), (7, 3), (3, 4)])
def test_prompt_split_is_the_products(n, k):
    """The ranges the table prints are the ones ``rlhf.rollout.generate.launch`` sends, seeds with them."""
    from rlhf.rollout.engine import Sampling
    from rlhf.rollout.generate import launch

    calls: list = []
    engines = [types.SimpleNamespace(generate=_Remote(calls, e)) for e in range(k)]
    prompts = [[i] for i in range(n)]
    seeds = gl.seeds_for(n, seed=3, step=2)
    launched = launch(engines, prompts, Sampling(n=8, seeds=seeds))
    shares = gl.engine_shares(n, k)
    assert launched.starts == [lo for lo, _ in shares]
    assert [(len(p), s.seeds) for _, p, s in calls] == [(hi - lo, seeds[lo:hi]) for lo, hi in shares]
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))  # contiguous, none twice
    assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= math.ceil(n / k)


def test_seeds_are_sampling_fors():
    from rlhf.rollout.generate import sampling_for

    ns = types.SimpleNamespace
    spec = ns(train=ns(seed=5), algo=ns(group_size=8),
              rollout=ns(seeded=True, max_response_tokens=512, temperature=1.0, top_p=1.0, top_k=-1))
    assert gl.seeds_for(32, seed=5, step=7) == sampling_for(spec, 7, 0, 32).seeds


def test_kv_cache_bytes():
    # Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 dims, K and V in bf16 = 12,288 bytes a token;
    # 256 sequences x 544 tokens = 1.71e9 bytes, x1.5 = 2.39 GiB -> 3 GiB
    assert gl.kv_cache_bytes(24, 2, 64, 256, 544) == 3 * gl.GiB
    # Qwen2.5-1.5B: 28 x 2 x 128: 28,672 bytes a token -> 3.99e9, x1.5 = 5.58 GiB -> 6 GiB
    assert gl.kv_cache_bytes(28, 2, 128, 256, 544) == 6 * gl.GiB
    assert gl.kv_cache_bytes(2, 1, 8, 1, 10) == 2 * gl.GiB  # the floor


def test_engine_configs(monkeypatch):
    from rlhf.rollout.vllm import EngineConfig

    monkeypatch.delenv("RLHF_VLLM_ARGS", raising=False)
    a = gl.parse_args([])
    kw = {v: EngineConfig(**gl.engine_config_dict(gl.VARIANTS[v], "/m", a, 3 * gl.GiB)).llm_kwargs()
          for v in gl.VARIANTS}
    base = kw["product"]
    assert base["kv_cache_memory_bytes"] == 3 * gl.GiB and base["enable_sleep_mode"]
    assert base["compilation_config"] == gl.GPU_SH_VLLM_ARGS["compilation_config"]
    assert base["max_model_len"] == 32 + 512 + 16 and "async_scheduling" not in base
    assert kw["async_off"]["async_scheduling"] is False
    assert "compilation_config" not in kw["graphs_default"]
    assert kw["seqs_256"]["max_num_seqs"] == 256 and kw["seqs_256"]["max_num_batched_tokens"] == 8192
    # every variant differs from the product's engine in what it says, and only there
    for v, k in kw.items():
        diff = {x for x in set(k) | set(base) if k.get(x) != base.get(x)}
        assert diff == {"product": set(), "async_off": {"async_scheduling"}, "graphs_default": {"compilation_config"},
                        "seqs_256": {"max_num_seqs", "max_num_batched_tokens"}, "v1_runner": set(),
                        "mp_core": set()}[v], v
    assert gl.VARIANTS["v1_runner"].env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert gl.engine_config_dict(gl.VARIANTS["mp_core"], "/m", a, 1)["multiprocessing"] is True
    monkeypatch.setenv("RLHF_VLLM_ARGS", '{"enforce_eager": false}')
    assert gl.engine_config_dict(gl.VARIANTS["product"], "/m", a, 1)["extra"] == {
        "enforce_eager": False, "kv_cache_memory_bytes": 1}


def test_parse_args_and_plan(monkeypatch, capsys):
    monkeypatch.setenv("JOB_TIMEOUT_S", "560")
    a = gl.parse_args(["--prompts", "30", "--levers", "engines_4"])
    assert a.budget_s == 540 and [lv.name for lv in a.lever_list] == ["baseline", "engines_4"]
    with pytest.raises(SystemExit):
        gl.parse_args(["--reps", "0"])
    assert gl.main(["--plan", "--prompts", "30", "--levers", "engines_4"]) == 0
    out = capsys.readouterr().out
    assert "engines: product x4" in out and "[prompts per engine: 8 + 8 + 8 + 6]" in out


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Future:
    def __init__(self, clock, wait):
        self.clock, self.wait = clock, wait

    def result(self):
        self.clock.t += self.wait
        return "out"


def test_step_timers():
    clock = _Clock()
    ns = types.SimpleNamespace

    def cost(dt, ret=None):
        def f(*a, **kw):
            clock.t += dt
            return ret() if callable(ret) else ret
        return f

    sched = ns(schedule=cost(0.001, lambda: ns(total_num_scheduled_tokens=sched.tokens)), tokens=256,
               update_from_output=cost(0.003))
    ex = ns(execute_model=cost(0.002, lambda: _Future(clock, 0.0)),
            sample_tokens=cost(0.0005, lambda: _Future(clock, 0.004)))
    t = gl.StepTimers(clock)
    assert t.wrap(sched, "schedule", "schedule", count=lambda o: o.total_num_scheduled_tokens > 0)
    assert t.wrap(sched, "update_from_output", "update_from_output")
    assert t.wrap(ex, "execute_model", "execute_model", futures=True)
    assert t.wrap(ex, "sample_tokens", "sample_tokens", futures=True)
    assert not t.wrap(None, "process_outputs", "process_outputs") and not t.wrap(ns(), "x", "x")
    for step in range(10):
        sched.tokens = 0 if step == 9 else 256  # an empty schedule is not a model step
        sched.schedule()
        ex.execute_model("so", non_block=True)
        ex.sample_tokens(None, non_block=True).result()
        sched.update_from_output("so", "out")
    r = t.read()
    assert r["steps"] == 9 and r["missing"] == ["process_outputs", "x"]
    assert r["seconds"]["schedule"] == pytest.approx(0.010) and r["calls"]["schedule"] == 10
    assert r["seconds"]["wait_gpu"] == pytest.approx(0.040) and r["calls"]["wait_gpu"] == 10
    assert r["seconds"]["sample_tokens"] == pytest.approx(0.005)  # the wait is not in the launch
    ms = gl.per_step_ms([r, {"steps": 0, "seconds": {}, "calls": {}}], [0.2, 0.0])
    assert ms["step"] == pytest.approx(1e3 * 0.2 / 9) and ms["update_from_output"] == pytest.approx(30 / 9)
    assert ms["steps"] == 9
    t.reset()
    assert t.read()["steps"] == 0 and set(t.read()["seconds"].values()) == {0.0}
    # engine core in another process: the front end's output batches count the steps
    mp = {"steps": 0, "seconds": {"process_outputs": 0.1, "llm_generate": 1.0}, "calls": {"process_outputs": 100}}
    assert gl.per_step_ms([mp], [1.0]) == pytest.approx({"step": 10.0, "process_outputs": 1.0, "steps": 100})


def test_sampler_and_mismatch():
    vals = iter([50.0, None, 70.0] + [ValueError] * 1000)

    def read():
        v = next(vals)
        if v is ValueError:
            raise ValueError("no reading")
        return v

    s = gl.Sampler(read, interval=0.001).start()
    time.sleep(0.05)
    assert s.stop() == pytest.approx(60.0)
    assert gl.Sampler(lambda: None, interval=0.001).start().stop() is None
    m = gl.mismatch_stats([[-1.0, -2.0], [-0.5]], [[-1.01, -1.98], [-0.5]])
    assert m["tokens"] == 3 and m["mean"] == pytest.approx(0.01) and m["max"] == pytest.approx(0.02)
    with pytest.raises(ValueError):
        gl.mismatch_stats([[-1.0, -2.0]], [[-1.0]])


def test_summary_and_table():
    runs = [{"wall_s": w, "gpu_busy": b, "llm_generate_s": [w - 0.5, w - 0.7],
             "per_step_ms": {"step": w, "steps": 512, "schedule": 1.0}} for w, b in ((6.0, 40), (5.0, 50), (5.5, None))]
    base = gl.summarize("baseline", runs, 131072)
    assert base["median_s"] == 5.5 and base["tok_per_s"] == pytest.approx(131072 / 5.5)
    assert base["llm_generate_s"] == 5.0 and base["gpu_busy"] == 45 and base["per_step_ms"]["step"] == 5.5
    two = gl.summarize("engines_2", [{"wall_s": 2.75, "gpu_busy": 90, "llm_generate_s": [2.5, 2.6]}], 131072)
    base["mismatch"], two["mismatch"] = {"mean": 0.008}, {"mean": 0.012}
    base["engines"], two["engines"] = 1, 2
    text = gl.format_table([base, two, {"lever": "v1_runner", "skipped": "engine not started"}], "T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].startswith("lever") and len(lines) == 5
    cells = lines[3].split()
    assert cells[0] == "engines_2" and cells[1] == "2" and cells[2] == "47663" and cells[3] == "2.000"
    assert cells[-3:] == ["90", "0.01200", "1.50"] and cells[5] == "2.600"
    assert lines[2].split()[3] == "1.000" and lines[4].startswith("v1_runner") and "engine not started" in lines[4]


# --------------------------------------------------------------------------- the engine, stand-in vLLM


@dataclass
class _Logprob:
    logprob: float
    rank: int = 1


class _FakeCore:
    """vLLM 0.26's EngineCore as the bench reaches it: scheduler + model executor."""

    def __init__(self):
        ns = types.SimpleNamespace
        self.scheduler = ns(schedule=lambda throttle=False: ns(total_num_scheduled_tokens=4),
                            update_from_output=lambda so, out: {})
        self.model_executor = ns(execute_model=lambda so, non_block=False: _Future(_Clock(), 0),
                                 sample_tokens=lambda g, non_block=False: _Future(_Clock(), 0))


class _FakeLLM:
    def __init__(self, **kw):
        self.kw, self.params = kw, []
        core = _FakeCore()
        ns = types.SimpleNamespace
        self.llm_engine = ns(output_processor=ns(process_outputs=lambda outs, **kw: None),
                             engine_core=ns(engine_core=core),
                             vllm_config=ns(compilation_config=ns(cudagraph_mode="FULL_AND_PIECEWISE",
                                                                  cudagraph_capture_sizes=[1, 2]),
                                            scheduler_config=ns(async_scheduling=True, max_num_seqs=1024,
                                                                max_num_batched_tokens=16384),
                                            use_v2_model_runner=True, max_concurrent_batches=2))

    def generate(self, prompts, params, use_tqdm=False):
        self.params.append(params)
        core, eng = self.llm_engine.engine_core.engine_core, self.llm_engine
        outs = []
        for p in prompts:
            sp = params[0] if isinstance(params, list) else params
            for _ in range(sp.max_tokens):  # the in-process step, as EngineCore.step_with_batch_queue runs it
                so = core.scheduler.schedule(False)
                core.model_executor.execute_model(so, non_block=True)
                core.model_executor.sample_tokens(None, non_block=True).result()
                core.scheduler.update_from_output(so, "out")
                eng.output_processor.process_outputs([])
            ids = [7] * sp.max_tokens
            lps = [{7: _Logprob(-0.25)} for _ in ids] if sp.logprobs is not None else None
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(index=0, token_ids=ids, logprobs=lps,
                                                                              finish_reason="length")]))
        return outs


class _SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def bench_engine(monkeypatch):
    import torch

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = _FakeLLM, _SamplingParams
    mod.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", mod)
    import rlhf.rollout.vllm as rv

    monkeypatch.setattr(rv, "_free_total", lambda: (100 << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    from bench.gen_engine import BenchEngine

    a = gl.parse_args([])
    cfg = rv.EngineConfig(**gl.engine_config_dict(gl.VARIANTS["async_off"], "/m", a, 2 * gl.GiB))
    return BenchEngine(cfg), mod


def test_bench_engine(bench_engine):
    from rlhf.rollout.engine import Sampling

    eng, _ = bench_engine
    assert eng.llm.kw["async_scheduling"] is False and eng.llm.kw["kv_cache_memory_bytes"] == 2 * gl.GiB
    out = eng.generate([[1, 2], [3]], Sampling(n=1, max_new_tokens=3))
    sp = eng.llm.params[-1]
    assert sp.ignore_eos and sp.logprobs == 0 and sp.flat_logprobs is False  # the bench's baseline: nested
    assert [s.logprobs for s in out] == [[-0.25] * 3] * 2
    r = eng.timers_read()
    assert r["steps"] == 6 and r["calls"]["llm_generate"] == 1 and r["calls"]["process_outputs"] == 6
    assert r["calls"]["wait_gpu"] == 6 and r["missing"] == []

    eng.set_options(flat=True)
    eng.timers_reset()
    eng.generate([[1]], Sampling(n=1, max_new_tokens=2))
    assert eng.llm.params[-1].flat_logprobs is True and eng.timers_read()["steps"] == 2

    eng.set_options(flat=False, logprobs=False)
    out = eng.generate([[1]], Sampling(n=1, max_new_tokens=2))
    assert eng.llm.params[-1].logprobs is None and out[0].logprobs == []
    s = eng.vllm_settings()
    assert s["async_scheduling"] is True and s["v2_model_runner"] and s["max_concurrent_batches"] == 2
    assert s["capture_sizes"] == [1, 2] and s["timers_missing"] == []


def test_engines_text():
    text = gl.engines_text({
        "product": [{"start_s": 41.2, "async_scheduling": True, "v2_model_runner": True, "max_num_seqs": 1024,
                     "max_num_batched_tokens": 16384, "cudagraph_mode": "FULL_AND_PIECEWISE",
                     "capture_sizes": [1, 2, 256], "timers_missing": []}, {"start_s": 30.0}],
        "v1_runner": [{"error": "not up in time"}]})
    lines = text.splitlines()
    assert lines[1].split() == ["product", "x2", "start", "41,", "30", "s;", "async", "True;", "v2", "True;", "seqs",
                                "1024;", "tokens", "16384;", "FULL_AND_PIECEWISE", "<=", "256", "(3", "sizes)"]
    assert lines[2].split() == ["v1_runner", "not", "started:", "not", "up", "in", "time"]


def test_kernel_busy_and_trace_text():
    # µs: [0,10] and [5,20] overlap -> 20 busy; [30,40] -> 10 more; span 0..50 with [45,50]
    k = gl.kernel_busy([(30, 40), (0, 10), (5, 20), (45, 50), (46, 48)])
    assert k["kernels"] == 5 and k["busy_s"] == pytest.approx(35e-6) and k["span_s"] == pytest.approx(50e-6)
    assert k["busy"] == pytest.approx(0.7)
    assert gl.kernel_busy([])["busy"] is None
    line = gl.trace_text({"wall_s": 0.5, "steps": 100, **gl.kernel_busy([(0, 2e5), (3e5, 4e5)])})
    assert "GPU busy 75.0 % of the 0.400 s kernel span" in line and "GPU 3.00 ms and wall 5.00 ms per step" in line
    assert gl.trace_text(None).endswith("not run") and "failed (boom)" in gl.trace_text({"error": "boom"})


def test_bench_engine_kernel_trace(bench_engine, monkeypatch):
    """The trace's plumbing (on CPU the profiler sees no kernels: the steps still count)."""
    import torch

    from rlhf.rollout.engine import Sampling

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    eng, _ = bench_engine
    t = eng.kernel_trace([[1, 2], [3]], Sampling(n=1, max_new_tokens=3))
    assert t["steps"] == 6 and t["kernels"] == 0 and t["busy"] is None and t["wall_s"] > 0
