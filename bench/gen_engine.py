"""The rollout engine of ``bench.gen_levers``: the product's ``VLLMEngine`` plus per-call options the
RL loop does not expose, step timers around vLLM's engine core, and the vLLM settings it resolved.
A module of its own so that Ray ships the class by reference (the workers import it)."""

from __future__ import annotations

import os
from typing import Any

from bench.gen_levers import StepTimers, kernel_busy
from rlhf.rollout.vllm import VLLMEngine


class BenchEngine(VLLMEngine):
    """``set_options(flat=, logprobs=, ignore_eos=)`` applies to every later ``generate`` call (the
    product's path, ``VLLMEngine.generate`` → ``generate_ids``); ``timers_reset`` / ``timers_read``
    give the seconds of each step part since the reset (``bench.gen_levers.StepTimers``)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.opts = {"flat": False, "logprobs": True, "ignore_eos": True}
        self.timers = StepTimers()
        self._instrument()

    def _instrument(self) -> None:
        """Wrap the step parts of vLLM 0.26: ``LLM.generate``; the front end's
        ``OutputProcessor.process_outputs`` (vllm/v1/engine/llm_engine.py ``LLMEngine.step``); and, with
        the engine core in this process (``InprocClient.engine_core``, vllm/v1/engine/core_client.py),
        ``EngineCore.scheduler.schedule`` / ``update_from_output`` and
        ``EngineCore.model_executor.execute_model`` / ``sample_tokens``, whose returned futures'
        ``result()`` is the wait for the GPU (vllm/v1/engine/core.py ``step_with_batch_queue``,
        vllm/v1/executor/uniproc_executor.py ``AsyncOutputFuture``)."""
        t, llm = self.timers, self.llm
        t.wrap(llm, "generate", "llm_generate")
        eng = getattr(llm, "llm_engine", None)
        t.wrap(getattr(eng, "output_processor", None), "process_outputs", "process_outputs")
        core = getattr(getattr(eng, "engine_core", None), "engine_core", None)  # None with a child process
        sched = getattr(core, "scheduler", None)
        t.wrap(sched, "schedule", "schedule", count=lambda out: getattr(out, "total_num_scheduled_tokens", 0) > 0)
        t.wrap(sched, "update_from_output", "update_from_output")
        ex = getattr(core, "model_executor", None)
        t.wrap(ex, "execute_model", "execute_model", futures=True)
        t.wrap(ex, "sample_tokens", "sample_tokens", futures=True)

    def set_options(self, **opts: Any) -> None:
        self.opts.update(opts)

    def generate_ids(self, prompts, **kw):
        """The product's, with this engine's options (keywords the caller gave win). ``flat`` sets the
        engine's ``flat_logprobs`` (the product's default is flat since the fourteenth session; this
        bench's baseline keeps the nested log-probs its twelfth-session table measured against)."""
        kw.setdefault("ignore_eos", self.opts["ignore_eos"])
        kw.setdefault("logprobs", self.opts["logprobs"])
        self.cfg.flat_logprobs = bool(self.opts["flat"])
        return super().generate_ids(prompts, **kw)

    def kernel_trace(self, prompts, sampling) -> dict:
        """One ``generate`` call under ``torch.profiler`` (CUDA activity only): the union of the
        kernels' intervals over the span from the first kernel's start to the last one's end is the
        GPU's busy fraction, exact where NVML's utilisation is a coarse sample; with the step timers,
        GPU ms per model step."""
        import time

        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self.timers.reset()
        # CUDA activity only: tracing the host's ops would slow the host side being measured
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            self.generate(prompts, sampling)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ivs = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
        return {"wall_s": wall, "steps": self.timers.read()["steps"], **kernel_busy(ivs)}

    def timers_reset(self) -> None:
        self.timers.reset()

    def timers_read(self) -> dict:
        return self.timers.read()

    def vllm_settings(self) -> dict:
        """What vLLM resolved (vllm/config/vllm.py ``VllmConfig``: ``use_v2_model_runner``,
        ``max_concurrent_batches``; vllm/config/scheduler.py; vllm/config/compilation.py)."""
        out: dict[str, Any] = {"start_s": self.start_seconds, "pid": os.getpid()}
        try:
            vc = self.llm.llm_engine.vllm_config
            cc, sc = vc.compilation_config, vc.scheduler_config
            out.update(async_scheduling=sc.async_scheduling, max_num_seqs=sc.max_num_seqs,
                       max_num_batched_tokens=sc.max_num_batched_tokens,
                       v2_model_runner=bool(vc.use_v2_model_runner), cudagraph_mode=str(cc.cudagraph_mode),
                       capture_sizes=list(cc.cudagraph_capture_sizes or []),
                       max_concurrent_batches=vc.max_concurrent_batches)
        except Exception as e:  # noqa: BLE001 - say what could not be read
            out["settings_error"] = repr(e)[:300]
        out["timers_missing"] = list(self.timers.missing)
        return out
