"""The vLLM rollout engine: one Ray actor per engine, token ids in, token ids and logprobs out.

``VLLMEngine`` wraps ``vllm.LLM`` with ``skip_tokenizer_init`` (the driver tokenizes), sleep mode
(hybrid placement frees the GPU for training between rollouts) and the weight-sync methods of
``rlhf.rollout.vllm_ext.WeightSyncExtension``. vLLM's allocator for sleep mode allows one engine per
process, hence one actor per engine.

* tensor_parallel == 1: the engine runs inside the actor process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  vLLM's in-process executor), on the actor's GPU or GPU share.
* tensor_parallel > 1: the actor holds no GPU and vLLM's Ray executor
  (``distributed_executor_backend="ray"``) starts one Ray worker per TP rank on the bundles
  ``bundle_indices`` (``VLLM_RAY_BUNDLE_INDICES``) of the actor's placement group, each taking
  ``gpu_share`` of its GPU (``VLLM_RAY_PER_WORKER_GPUS``). The launcher decides both
  (``rlhf.launch.cluster.placement``) and the rollout worker passes them here.

Sampled-token logprobs come from vLLM's sampler in ``processed_logprobs`` mode (after temperature,
like the trainer's ``token_logprobs(logits, tokens, temperature)``); ``rlhf.algos.kl.logprob_mismatch``
compares them with the trainer's recomputation. What the plan and the launcher know of this engine
is its kind, ``rlhf.rollout.vllm_kind``.

Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rlhf.rollout.engine import Sample, Sampling, one_request
from rlhf.spec.runspec import RunSpec

GiB = 1 << 30

# NVLink multicast stays off on the lent machines (it can take the host's GPUs down).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _set_safe_env() -> None:
    """SAFE_ENV's settings, where the process has none of its own."""
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)


def import_vllm() -> None:
    """vLLM's modules, imported ahead of an engine's start (``VLLMKind.prepare``: seconds a process,
    overlapping the models' loading instead of following it). Nothing here touches the GPU, and vLLM
    reads its VLLM_* settings when an engine starts, after ``VLLMEngine`` has set them."""
    _set_safe_env()
    from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401


@dataclass
class EngineConfig:
    model_path: str
    tensor_parallel: int = 1
    dtype: str = "bfloat16"
    seed: int = 0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    enable_sleep_mode: bool = True
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    bundle_indices: Optional[Sequence[int]] = None  # TP>1: the placement-group bundles of the ranks
    gpu_share: float = 1.0  # TP>1: GPU fraction of each rank's Ray worker
    eos_token_id: Optional[int] = None  # stop token when no tokenizer is given
    # TP 1: run vLLM's engine core in a child process (vLLM's default) instead of this one
    multiprocessing: bool = False
    # sampled-token logprobs as one FlatLogprobs per sample (a few flat lists) instead of a dict and a
    # Logprob object per token: vLLM's output handling runs on the host between decode steps, and at
    # 0.5B decoding is host-bound; the GRPO loop's generation phase 1.045x faster (BENCHMARKS §10)
    flat_logprobs: bool = True
    extra: dict = field(default_factory=dict)  # more vllm.LLM keyword arguments

    def llm_kwargs(self) -> dict[str, Any]:
        """The ``vllm.LLM`` keyword arguments of these settings."""
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            skip_tokenizer_init=True,
            tensor_parallel_size=int(self.tensor_parallel),
            dtype=self.dtype,
            seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_sleep_mode=self.enable_sleep_mode,
            enable_prefix_caching=self.enable_prefix_caching,
            worker_extension_cls="rlhf.rollout.vllm_ext.WeightSyncExtension",
            logprobs_mode="processed_logprobs",
        )
        if self.max_model_len:
            kwargs["max_model_len"] = int(self.max_model_len)
        if self.max_num_seqs:
            kwargs["max_num_seqs"] = int(self.max_num_seqs)
        if self.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = int(self.max_num_batched_tokens)
        if int(self.tensor_parallel) > 1:
            kwargs["distributed_executor_backend"] = "ray"
        kwargs.update(self.extra)
        return kwargs


def _free_total() -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


class VLLMEngine:
    """A vLLM engine in this process; implements ``rlhf.rollout.engine.RolloutEngine``.

    ``VLLMEngine(spec, tokenizer)`` (what ``rlhf.rollout.vllm_kind.VLLMKind.create`` calls) takes the settings
    from a run spec (keyword arguments: ``EngineConfig`` fields over the spec's);
    ``VLLMEngine(EngineConfig(...))`` from explicit settings. The weight-sync methods below are
    what the trainer's senders call through the rollout worker.
    """

    def __init__(self, cfg: Any, tokenizer: Any = None, **over: Any) -> None:
        if isinstance(cfg, dict):
            cfg = EngineConfig(**cfg)
        elif not isinstance(cfg, EngineConfig):  # a RunSpec
            from rlhf.models import model_dir

            cfg = engine_config(cfg, model_dir(cfg), **over)
        self.cfg = cfg
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else cfg.eos_token_id
        _set_safe_env()
        tp = int(cfg.tensor_parallel)
        kwargs = cfg.llm_kwargs()
        if tp == 1 and not cfg.multiprocessing:
            # the engine core and its worker in this process: collective_rpc runs here, and the CUDA
            # IPC handles open in the process that holds the model
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            if tp == 1:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            # weight-sync arguments (IPC handles, tensor metadata) cross to the engine core pickled
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if tp > 1:
            if cfg.bundle_indices is not None:
                os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(int(i)) for i in cfg.bundle_indices)
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(cfg.gpu_share)
        self.in_process = tp == 1  # this process can see the engine's GPU
        if self.in_process:
            torch.cuda.init()
        self.mem_before = _free_total() if self.in_process else (0, 0)
        t0 = time.perf_counter()
        from vllm import LLM

        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.mem_after_start = _free_total() if self.in_process else (0, 0)
        self.asleep = False

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Any = None, **kw: Any) -> list[Sample]:
        """``RolloutEngine.generate``: ``sampling.n`` samples per prompt, prompt-major.
        ``sampling.seeds[i]`` seeds prompt i (vLLM gives the j-th sample seed + j). Keyword
        arguments instead of ``sampling``: see ``generate_ids``."""
        if sampling is not None:
            kw = dict(
                n=sampling.n,
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seeds=tuple(sampling.seeds) or None,
                stop_token_ids=tuple(sampling.stop_token_ids) or None,
                **kw,
            )
        return self.generate_ids(prompt_token_ids, **kw)

    def sample(self, prompt_ids: Sequence[int], sampling: Sampling) -> Sample:
        """``RolloutEngine.sample``: one continuation of ``prompt_ids``. (``vllm.LLM`` runs one
        call at a time; concurrent requests of one process go through ``RequestBatcher``.)"""
        return self.generate([list(prompt_ids)], one_request(sampling))[0]

    def close(self) -> None:
        """Shut the engine down (its engine core and, TP > 1, its Ray workers)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:  # the trainer's NCCL group (disaggregated weight sync), if one was made
            llm.collective_rpc("rlhf_close_weight_group")
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: bool = False,
        logprobs: bool = True,
        seeds: Optional[Sequence[int]] = None,
    ) -> list[Sample]:
        """``n`` samples per prompt, in prompt order (prompt 0's n samples first). Stops at the
        tokenizer's EOS (and ``stop_token_ids``) unless ``ignore_eos``."""
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before generate()")
        stops = list(stop_token_ids or [])
        if self.eos_token_id is not None and self.eos_token_id not in stops:
            stops.append(int(self.eos_token_id))

        def params(seed: Optional[int]) -> Any:
            return SamplingParams(
                n=int(n),
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k) if top_k and top_k > 0 else -1,
                stop_token_ids=None if ignore_eos else (stops or None),
                ignore_eos=bool(ignore_eos),
                logprobs=0 if logprobs else None,
                flat_logprobs=bool(logprobs and self.cfg.flat_logprobs),
                detokenize=False,
                seed=None if seed is None else int(seed) % (2**63),
            )

        if seeds:
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
            sp: Any = [params(s) for s in seeds]
        else:
            sp = params(None)
        inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outs = self.llm.generate(inputs, sp, use_tqdm=False)
        samples: list[Sample] = []
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = _sampled_logprobs(c.logprobs, ids) if logprobs else []
                samples.append(Sample(ids, lps, _finish(c.finish_reason), prompt_index=i))
        return samples

    def generate_packed(self, prompts: Sequence[Sequence[int]], **kw) -> dict[str, Any]:
        """Like ``generate_ids`` but as flat arrays (cheaper through Ray for big batches):
        ``prompt_index [S]``, ``lengths [S]``, ``token_ids [sum lengths]``, ``logprobs``, ``finish``."""
        import numpy as np

        samples = self.generate_ids(prompts, **kw)
        lengths = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
        return {
            "prompt_index": np.array([s.prompt_index for s in samples], dtype=np.int64),
            "lengths": lengths,
            "token_ids": np.fromiter((t for s in samples for t in s.response_ids), dtype=np.int64, count=int(lengths.sum())),
            "logprobs": np.fromiter((x for s in samples for x in s.logprobs), dtype=np.float32),
            "finish": [s.finish_reason for s in samples],
        }

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> dict[str, float]:
        """Free the GPU: level 1 keeps the weights in host memory, level 2 drops them (the next
        weight sync must then write every tensor). Returns seconds, and (TP 1) this engine's GPU
        memory awake and asleep as NVML attributes it to the process (else device-wide free memory)."""
        awake = gpu_bytes_of_process() if self.in_process else None
        free0 = _free_total()[0] if self.in_process else 0
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        self.asleep = True
        out = {"time/sleep": time.perf_counter() - t0}
        if self.in_process:
            free1, _ = _free_total()
            asleep = gpu_bytes_of_process()
            if awake is None or asleep is None:  # no per-process accounting: what the engine took at start
                awake = max(self.mem_before[0] - self.mem_after_start[0], 1)
                asleep = max(awake - (free1 - free0), 0)
            out.update({
                "memory/vllm_gib": awake / GiB,
                "memory/vllm_asleep_gib": asleep / GiB,
                "memory/vllm_freed_gib": (awake - asleep) / GiB,
                "memory/vllm_freed_fraction": (awake - asleep) / max(awake, 1),
                "memory/free_after_sleep_gib": free1 / GiB,
            })
        return out

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> float:
        """Reallocate: ``["weights"]`` before a weight sync, then ``["kv_cache"]``; None = all."""
        t0 = time.perf_counter()
        self.llm.wake_up(tags=list(tags) if tags else None)
        if not tags or "kv_cache" in tags:
            self.asleep = False
        return time.perf_counter() - t0

    def reset_prefix_cache(self) -> None:
        """Cached KV blocks were computed with the old weights: drop them after a weight sync."""
        try:
            self.llm.reset_prefix_cache()
        except Exception:  # noqa: BLE001 - older signatures, or nothing cached
            pass

    # ------------------------------------------------------------------ weight sync

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """``RolloutEngine.load_weights``: full tensors by checkpoint name (any device). The GPU
        transports in ``rlhf.workers.sync_cuda`` are the fast path; this one suits small models."""
        self.llm.collective_rpc("rlhf_load_tensors", args=(list(named_tensors.items()),))
        self.reset_prefix_cache()

    def load_ipc(self, handles: dict, metas: list) -> float:
        """One bucket through CUDA IPC; returns the slowest worker's seconds."""
        return max(self.llm.collective_rpc("rlhf_load_ipc", args=(handles, metas)))

    def load_nccl(self, metas: list, nbytes: int) -> float:
        """One bucket by NCCL broadcast; returns the slowest worker's seconds."""
        return max(self.llm.collective_rpc("rlhf_load_nccl", args=(metas, nbytes)))

    def sync_done(self, release: bool = True) -> None:
        """After the last bucket: drop KV blocks cached under the old weights; ``release`` the
        senders' IPC buffers (False when the sender keeps them for the next sync)."""
        self.llm.collective_rpc("rlhf_sync_done", args=(release,))
        self.reset_prefix_cache()

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> list[int]:
        return self.llm.collective_rpc(
            "rlhf_init_weight_group", args=(master_address, master_port, rank_offset, world_size)
        )

    def weight_digest(self) -> dict[str, float]:
        return self.llm.collective_rpc("rlhf_weight_digest")[0]

    # ------------------------------------------------------------------ info

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"start_seconds": self.start_seconds, "tensor_parallel": self.cfg.tensor_parallel}
        if self.in_process:
            out["vllm_gib"] = (self.mem_before[0] - self.mem_after_start[0]) / GiB
            out["free_gib"] = _free_total()[0] / GiB
        return out

    def ready(self) -> bool:
        return True


def _finish(reason: Any) -> str:
    r = str(reason) if reason is not None else "length"
    return "stop" if r in ("stop", "eos", "abort_stop") else ("length" if r in ("length", "None") else r)


def _sampled_logprobs(lp: Any, ids: Sequence[int]) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position logprobs (a list of
    ``{token_id: Logprob}`` or a ``FlatLogprobs``)."""
    if lp is None:
        return []
    if hasattr(lp, "start_indices") and hasattr(lp, "token_ids"):  # FlatLogprobs
        # logprobs=0 gives one entry per position, the sampled token's: the column is the answer
        if len(lp.token_ids) == len(ids) and list(lp.token_ids) == list(ids):
            return [float(x) for x in lp.logprobs]
        out = []
        for pos, tok in enumerate(ids):
            s, e = lp.start_indices[pos], lp.end_indices[pos]
            val = None
            for j in range(s, e):
                if lp.token_ids[j] == tok:
                    val = lp.logprobs[j]
                    break
            out.append(float(val if val is not None else lp.logprobs[s]))
        return out
    out = []
    for pos, tok in enumerate(ids):
        d = lp[pos]
        v = d.get(tok) if d else None
        out.append(float(v.logprob if v is not None else next(iter(d.values())).logprob))
    return out


# --------------------------------------------------------------------------- factory


def engine_config(spec: RunSpec, model_path: str, **over: Any) -> EngineConfig:
    """The engine settings of a run spec."""
    r = spec.rollout
    cfg = EngineConfig(
        model_path=model_path,
        tensor_parallel=spec.layout.rollout_tp,
        dtype=spec.model.dtype,
        seed=spec.train.seed,
        # engines sharing a GPU split vLLM's share of it (each a per-process limit in vLLM)
        gpu_memory_utilization=r.gpu_memory_utilization / spec.layout.engines_per_device,
        enforce_eager=r.enforce_eager,
        enable_sleep_mode=spec.layout.rollout_beside_training and spec.placement.sleep_rollout,
        max_model_len=r.max_prompt_tokens + r.max_response_tokens,
    )
    extra = os.environ.get("RLHF_VLLM_ARGS")  # more vllm.LLM arguments, JSON (benchmarks, tuning)
    if extra:
        import json

        cfg.extra.update(json.loads(extra))
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def gpu_bytes_of_process(pid: Optional[int] = None) -> Optional[int]:
    """GPU memory that NVML attributes to process ``pid`` (default: this one), over all GPUs."""
    import os

    pid = os.getpid() if pid is None else pid
    try:
        import pynvml

        pynvml.nvmlInit()
        total, found = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    total += int(p.usedGpuMemory)
                    found = True
        return total if found else None
    except Exception:  # noqa: BLE001 - no NVML here
        return None
