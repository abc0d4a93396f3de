"""End to end: a GRPO step of the framework vs TRL's ``GRPOTrainer`` (BENCHMARKS.md §4).

One command runs both sides, one after the other, each in its own process (the GPU is free
between them), on the same work:

* the same random-weight model directory (``bench.make_model``: Qwen2.5-0.5B shape, bf16, the
  byte-level BPE tokenizer of ``bench.common``), loaded by both sides from disk, no hub;
* the same prompts in the same order (a jsonl file written here; our side reads it with
  ``data.shuffle=false``, TRL with ``shuffle_dataset=False``), P prompts per step, G samples each;
* the same lengths: prompts <= 128 tokens, at most 256 new tokens, temperature 1, no top-k/p.
  Neither side is told to ignore EOS (our rollout spec has no such switch): a random model puts
  ~1/151936 of its mass on EOS, so nearly every sample runs to the limit on both sides; the
  mean completion length of each side is reported, and tokens/s with it;
* the same batch math: one optimizer step per GRPO step over all P*G samples, micro-batches of
  M (so P*G/M accumulation steps), token-mean loss over the whole batch (ours ``loss_agg``
  token_mean = TRL ``loss_type="dapo"``), group-std-normalised advantages, clip 0.2, one epoch,
  lr 1e-6 constant, grad clip 1.0, KL coefficient 0 (no reference model) unless ``--kl``;
* vLLM colocated on the same GPU on both sides, the same ``gpu_memory_utilization`` and the same
  CUDA-graph capture sizes (``RLHF_VLLM_ARGS``, which ``scripts/gpu.sh`` sets, is passed to TRL's
  ``vllm.LLM`` too: ``--trl-vllm-args none`` leaves TRL's engine as TRL builds it); sleep mode on
  both sides (``--sleep off``: neither; ``--sleep auto``: each side's default, ours the plan's
  ``placement.sleep_rollout=auto`` and TRL's ``vllm_enable_sleep_mode`` off; ``--trl-sleep`` sets TRL's alone);
* both compute the trainer's log-probs of the sampled tokens before the update (ours always does
  with vLLM; TRL does for its vLLM importance-sampling correction, on by default).

Ours: ``python -m rlhf.cli recipe=grpo_qwen05_random_1xh200 ...`` (the entry of
scripts/grpo_gpu.sh): DeepSpeed bf16 (fp32 master weights) at the plan's ZeRO stage (ZeRO-1 at one rank
since BENCHMARKS §12; ZeRO-2 before), hybrid placement, CUDA IPC
weight sync. Phase times come from its metrics.jsonl. The run is stopped once its last step is
logged (its end-of-run checkpoint is not part of the benchmark).

TRL: ``GRPOTrainer`` in one plain Python process (no ``accelerate launch``), ``use_vllm=True,
vllm_mode="colocate"``, bf16 weights (its fastest setting; ``--trl-dtype float32`` gives TRL's
default, fp32 weights under bf16 autocast), torch fused AdamW, no gradient
checkpointing (ours has none either). Phase times come from wrapping the trainer's own methods
(``_generate_single_turn``, ``vllm_generation.sync_weights``, ``_calculate_rewards``, the no-grad
``_get_per_token_logps_and_entropies``, ``_prepare_inputs``) and a callback around each optimizer
step (``on_step_begin`` .. ``on_step_end``, after a CUDA synchronize).
If TRL's vLLM path fails before its first step, TRL runs again with ``use_vllm=False`` (HF
``generate``) when time is left (``--trl-fallback none``: not); the table says which ran.

The first ``--warmup`` steps of each side are left out; the table gives the mean (and median) of
the next ``--steps`` steps per phase, the ratio TRL/ours, tokens/s, each side's start-up time and
the package versions. Every figure also goes to results.jsonl (``bench.checks.record``) and
``bench_e2e_trl.json``.

    bash scripts/gpu.sh bench-e2e-trl                    # on the device, TRL in the bundle
    python -m bench.e2e_trl                              # the same, without gpu.sh's job wrapper
    python -m bench.e2e_trl --plan                       # both sides' settings, our spec's --plan; no GPU
    python -m bench.e2e_trl --cpu-test                   # tiny model on CPU: TRL (HF generate) + ours, 2 steps
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import signal
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import kill_tagged

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "grpo_qwen05_random_1xh200"
GOAL = 2.0  # our step at least this many times faster than TRL's (issue: GPU speed)
DEFAULT_MODEL = "/tmp/rlhf-gpu/models/qwen2.5-0.5b-random"
DEFAULT_WORK = "/tmp/rlhf-gpu/e2e_trl"
# what every child gets unless the caller set it (scripts/gpu.sh sets the same)
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1", "TORCH_CUDA_ARCH_LIST": "9.0",
}
T0 = time.time()


def say(msg: str) -> None:
    """A line of the driver's, stamped with the seconds since it started."""
    print(f"e2e [{time.time() - T0:5.0f} s]: {msg}", flush=True)


PHASES = ("generate", "sync", "reward", "logp", "update", "other", "step")
PHASE_DOC = {
    "generate": "generate",
    "sync": "weight sync + sleep/wake/offload",
    "reward": "reward",
    "logp": "old log-probs (+ reference)",
    "update": "update (fwd+bwd+optim)",
    "other": "other",
    "step": "step",
}
# our metrics.jsonl keys per phase (time/<phase> of rlhf.loops.rl)
OURS_KEYS = {
    "generate": ("time/generate",),
    "sync": ("time/to_train", "time/sync"),
    "reward": ("time/reward",),
    "logp": ("time/reference", "time/old_logp"),
    "update": ("time/update",),
}
VERSION_PKGS = ("torch", "transformers", "trl", "vllm", "deepspeed", "ray", "accelerate", "datasets",
                "tokenizers", "hydra-core")


# ----------------------------------------------------------------------------- arguments


def default_budget() -> float:
    if os.environ.get("E2E_BUDGET_S"):
        return float(os.environ["E2E_BUDGET_S"])
    if os.environ.get("JOB_TIMEOUT_S"):
        return max(60.0, float(os.environ["JOB_TIMEOUT_S"]) - 30)
    return 520.0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.e2e_trl", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default="ours,trl", help="which sides, in this order (ours,trl)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the figures, per side")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after the warm-up, per side")
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new", type=int, default=256, help="max new tokens per sample")
    ap.add_argument("--max-prompt", type=int, default=128, help="max prompt tokens")
    ap.add_argument("--prompt-words", type=int, default=32, help="words per prompt (about as many tokens)")
    ap.add_argument("--micro", type=int, default=16, help="samples per forward/backward (both sides)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kl", type=float, default=0.0, help="KL coefficient (k3 in the loss, both sides)")
    ap.add_argument("--sleep", choices=("on", "off", "auto"), default="on",
                    help="vLLM sleep mode (ours: also DeepSpeed state offload) on both sides; auto: each side's "
                         "default (ours placement.sleep_rollout=auto, the plan's choice; TRL's vllm_enable_sleep_mode "
                         "default, off)")
    ap.add_argument("--offload", choices=("auto", "true", "false"), default="auto",
                    help="our placement.offload_train_state (auto: resident when the plan says both phases fit)")
    ap.add_argument("--ours-tokens", type=int, default=32768,
                    help="our train.max_tokens_per_micro_batch (packed micro-batches); 0 = null, the plan's "
                         "choice (on a GPU the largest power of two ≤ 32,768 that fits)")
    ap.add_argument("--liger", nargs="?", const="true", default="auto", choices=("auto", "true", "false"),
                    help="our model.liger_kernels (default auto: on when liger-kernel is installed and covers the model type)")
    ap.add_argument("--trl-sleep", choices=("on", "off"), default=None, help="TRL's vllm_enable_sleep_mode alone")
    ap.add_argument("--trl-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="TRL's model weights (bfloat16: its fastest; float32 = TRL's default, bf16 autocast)")
    ap.add_argument("--trl-vllm-args", choices=("same", "none"), default="same",
                    help="pass RLHF_VLLM_ARGS (CUDA-graph sizes) to TRL's vllm.LLM too")
    ap.add_argument("--trl-fallback", choices=("hf", "none"), default="hf",
                    help="if TRL's vLLM path fails before a step: rerun TRL with HF generate")
    ap.add_argument("--gpu-util", type=float, default=0.5, help="vLLM gpu_memory_utilization (both sides)")
    ap.add_argument("--budget-s", type=float, default=default_budget(),
                    help="wall seconds for everything (default: E2E_BUDGET_S, else scripts/gpu.sh's job "
                         "timeout JOB_TIMEOUT_S less 30, else 520)")
    ap.add_argument("--side-reserve-s", type=float, default=200,
                    help="seconds kept for each later side: a side may run until the budget minus these")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="model shape for bench.make_model")
    ap.add_argument("--model", default=None, help=f"model dir (default {DEFAULT_MODEL} for the preset)")
    ap.add_argument("--work", default=DEFAULT_WORK, help="scratch dir: prompts, run dirs, side logs")
    ap.add_argument("--trl-python", default=sys.executable,
                    help="the Python that runs the TRL side (default: this one)")
    ap.add_argument("--ours-extra", default="", help="more rlhf.cli overrides for our side (space separated)")
    ap.add_argument("--plan", action="store_true", help="print both sides' settings and our --plan; run nothing")
    ap.add_argument("--cpu-test", action="store_true",
                    help="tiny model on CPU, 1+1 steps: TRL with HF generate and ours with hardware=cpu")
    ap.add_argument("--child", choices=("trl", "trl-check"), help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_test:
        a.prompts_per_step, a.group, a.max_new, a.max_prompt, a.micro = 2, 2, 8, 64, 2
        a.warmup, a.steps, a.prompt_words = 1, 1, 8
        a.work = a.work if a.work != DEFAULT_WORK else "/tmp/rlhf-e2e-cputest"
    if a.model is None:
        a.model = (str(Path(a.work) / "tiny-model") if a.cpu_test
                   else DEFAULT_MODEL.replace("qwen2.5-0.5b", a.preset))
    a.sides = [s for s in a.sides.split(",") if s]
    bad = [s for s in a.sides if s not in ("ours", "trl")]
    if bad:
        ap.error(f"--sides: unknown {bad}; use ours and/or trl")
    samples = a.prompts_per_step * a.group
    if a.group < 2:
        ap.error("--group must be >= 2 (GRPO needs a group)")
    if samples % a.micro:
        ap.error(f"--micro {a.micro} must divide prompts-per-step x group = {samples}")
    if a.warmup < 0 or a.steps < 1:
        ap.error("--warmup >= 0 and --steps >= 1")
    if a.trl_sleep is None:
        a.trl_sleep = "off" if a.sleep == "auto" else a.sleep
    return a


def total_steps(a) -> int:
    return a.warmup + a.steps


def grad_accum(a) -> int:
    return a.prompts_per_step * a.group // a.micro


# ----------------------------------------------------------------------------- shared inputs


def make_prompts(n: int, words: int, seed: int = 0) -> list[dict]:
    """n prompt rows of about ``words`` words from bench.common's synthetic corpus (deterministic)."""
    import random

    from bench.common import _corpus

    rng = random.Random(seed)
    corpus = _corpus()
    rows = []
    for _ in range(n):
        w: list[str] = []
        while len(w) < words:
            w += rng.choice(corpus).split()
        rows.append({"prompt": " ".join(w[:words])})
    return rows


def write_prompts(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def prompt_token_lengths(model_dir: str, rows: list[dict]) -> list[int]:
    """Token counts of the prompts as the product tokenizes them (``rlhf.models.load_tokenizer``,
    AutoTokenizer, special tokens added as ``rlhf.loops.rl.tokenize_prompts`` does without a chat
    template), so the limit check sees what the run will see."""
    from rlhf.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    return [len(tok(r["prompt"], add_special_tokens=True)["input_ids"]) for r in rows]


def make_tiny_model(out: Path) -> str:
    """A 2-layer Qwen2 with bench.common's tokenizer, for the CPU test (built once)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.common import build_tokenizer

    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return str(out)
    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def ensure_model(a) -> str:
    if a.cpu_test:
        return make_tiny_model(Path(a.model))
    if (Path(a.model) / "config.json").exists() and (Path(a.model) / "tokenizer_config.json").exists():
        return a.model
    # its own process: building on the GPU must not leave a CUDA context in this one
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "bench.make_model", a.preset, a.model], cwd=ROOT,
                       env=child_env({}), timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"bench.make_model failed (exit {r.returncode})")
    say(f"built {a.model} in {time.time() - t:.0f} s")
    return a.model


# ----------------------------------------------------------------------------- our side


def ours_overrides(a, model: str, prompts_file: str, run_dir: str, device_gb: float | None = None) -> list[str]:
    on = {"on": "true", "off": "false", "auto": "auto"}[a.sleep]
    ov = [
        f"recipe={RECIPE}",
        f"model.path={model}",
        f"train.steps={total_steps(a)}",
        f"train.prompts_per_step={a.prompts_per_step}",
        f"train.micro_batch_size={a.micro}",
        f"algo.group_size={a.group}",
        f"algo.lr={a.lr}",
        f"algo.kl.coef={a.kl}",
        "algo.kl.estimator=k3",
        "algo.kl.placement=loss",
        "algo.loss_agg=token_mean",
        "algo.epochs=1",
        f"rollout.max_prompt_tokens={a.max_prompt}",
        f"rollout.max_response_tokens={a.max_new}",
        "rollout.temperature=1.0",
        f"rollout.gpu_memory_utilization={a.gpu_util}",
        f"data.train_files=[{prompts_file}]",
        "data.shuffle=false",
        f"placement.sleep_rollout={on}",
        f"placement.offload_train_state={a.offload if a.sleep != 'off' else 'false'}",
        f"train.max_tokens_per_micro_batch={a.ours_tokens or 'null'}",
        f"model.liger_kernels={a.liger}",
        "tracking.console=plain",
        f"output_dir={run_dir}",
    ]
    if a.cpu_test:  # the framework's CPU path: Ray CPU slots, DeepSpeed on gloo, HF generate
        ov += ["hardware=cpu", "train.zero_stage=0", "model.dtype=float32", "model.vocab=2048",
               "model.hidden=64", "model.intermediate=128", "model.n_layers=2", "model.n_heads=4",
               "model.n_kv_heads=2"]
    if device_gb is not None:  # the GPU's own total: the recipe says an H200's, and a smaller GPU is refused
        ov.append(f"hardware.device_memory_gb={device_gb:g}")
    ov += shlex.split(a.ours_extra)
    return ov


def gpu_total_gb() -> float | None:
    """The first GPU's total as CUDA reports it, in GB rounded down to 0.1 (what
    ``hardware.device_memory_gb`` states), from a child process (no CUDA context in this one); None
    without a GPU."""
    try:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[1])"],
                           capture_output=True, text=True, timeout=60)
        return math.floor(int(r.stdout.strip()) / 1e8) / 10
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def ours_metrics_name(a) -> str:
    """The name our run's metrics are copied to under $OUT: the preset, the response length and a
    tag of all our side's overrides (paths left out), so that runs with other settings (--kl,
    --liger, --ours-tokens, --ours-extra, ...) do not overwrite each other's file."""
    tag = hashlib.sha1(" ".join(ours_overrides(a, "", "", "")).encode()).hexdigest()[:8]
    return f"e2e_ours_metrics_{a.preset}_{a.max_new}_{tag}.jsonl"


def ours_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return rows


def compiles(summary: dict) -> str:
    """"; updates [s...], graphs compiled [n...]" for a side that reports its compiles (ours), every step."""
    if "compiled_graphs" not in summary:
        return ""
    return f"; updates {summary['update_times']} s, graphs compiled {summary['compiled_graphs']}"


def ours_step(r: dict, samples: int) -> dict:
    out = {"step": r.get("step")}
    for ph, keys in OURS_KEYS.items():
        out[ph] = sum(float(r.get(k, 0.0)) for k in keys)
    out["step_s"] = float(r.get("time/step", 0.0))
    out["other"] = out["step_s"] - sum(out[p] for p in OURS_KEYS)
    out["tokens"] = float(r.get("response/length_mean", 0.0)) * samples
    out["mean_len"] = float(r.get("response/length_mean", 0.0))
    out["truncated"] = float(r.get("response/truncation_rate", 0.0))
    out["reward_mean"] = r.get("reward/mean")  # not the "reward" phase's seconds
    out["mismatch"] = r.get("mismatch/logp_abs_mean")
    out["mfu"] = r.get("perf/mfu")  # the actor update's, of the hardware's peak
    out["fwd_bwd_mfu"] = r.get("perf/fwd_bwd_mfu")  # the same without its optimizer steps
    out["optimizer_s"] = r.get("time/actor_optimizer_step")
    out["reference_s"] = r.get("time/reference")  # the two passes the "logp" phase sums, apart
    out["old_logp_s"] = r.get("time/old_logp")
    out["compiled_graphs"] = r.get("perf/compiled_graphs")  # a slow update with some: a recompile
    return out


# ----------------------------------------------------------------------------- TRL side: settings


def trl_config_kwargs(a, out_dir: str, use_vllm: bool, cpu: bool) -> dict:
    """GRPOConfig arguments that give TRL the same work as our side (TRL 1.16 names)."""
    kw = dict(
        output_dir=out_dir,
        seed=0,
        max_steps=total_steps(a),
        per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=grad_accum(a),  # steps_per_generation defaults to it:
        num_generations=a.group,                    # one generation of P*G samples per optimizer step
        num_iterations=1,
        max_completion_length=a.max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=a.kl,                 # 0: no reference model (TRL's default)
        loss_type="dapo",          # token mean over the whole accumulated batch = ours token_mean
        scale_rewards="group",     # = ours normalize_std
        epsilon=0.2,
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": a.trl_dtype},
        shuffle_dataset=False,     # prompts in file order, like ours with data.shuffle=false
        dataloader_num_workers=0,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        use_vllm=use_vllm,
    )
    if use_vllm:
        kw.update(
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=a.gpu_util,
            vllm_enable_sleep_mode=a.trl_sleep == "on",
            vllm_max_model_length=a.max_prompt + a.max_new,
            vllm_importance_sampling_correction=True,  # TRL's default; makes it compute old log-probs like ours
        )
    if cpu:
        kw.update(use_cpu=True, bf16=False)
    else:
        kw.update(bf16=True)
    return kw


# ----------------------------------------------------------------------------- TRL side: the child


def trl_child(cfg_path: str) -> int:
    """Runs in its own process: builds GRPOTrainer, trains, writes one JSON line per step."""
    t_start = time.time()
    cfg = json.loads(Path(cfg_path).read_text())
    out = Path(cfg["result"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg["use_vllm"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # TRL reaches into the in-process engine

    def emit(obj: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(obj, default=str) + "\n")
        print("E2E_TRL " + json.dumps(obj, default=str), flush=True)

    import functools

    import torch

    t = time.time()
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    if cfg["use_vllm"]:
        import vllm

        versions["vllm"] = vllm.__version__
        from trl.import_utils import is_vllm_available

        versions["trl_accepts_vllm"] = bool(is_vllm_available())
        extra = cfg.get("vllm_extra") or {}
        if extra:  # the same vllm.LLM extras as our engines (CUDA-graph capture sizes)
            import trl.generation.vllm_generation as vg

            base_llm = vg.LLM

            def llm_with_extra(*args, **kwargs):
                for k, v in extra.items():
                    kwargs.setdefault(k, v)
                return base_llm(*args, **kwargs)

            vg.LLM = llm_with_extra
    emit({"event": "imported", "seconds": time.time() - t, "versions": versions})

    from bench.rewards import letters

    def trl_letters(prompts, completions, **kwargs):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return letters(list(prompts), texts)

    rows = [json.loads(line) for line in Path(cfg["prompts"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    args = GRPOConfig(**cfg["config"])
    resolved = {k: getattr(args, k, None) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
        "steps_per_generation", "num_generations", "max_completion_length", "beta", "loss_type",
        "scale_rewards", "bf16", "gradient_checkpointing", "optim", "learning_rate", "lr_scheduler_type",
        "use_vllm", "vllm_mode", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
        "vllm_importance_sampling_correction", "max_steps", "shuffle_dataset", "model_init_kwargs")}
    emit({"event": "config", "resolved": resolved})

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    acc: dict[str, float] = {}
    stack: list[list] = []
    tokens = {"n": 0, "samples": 0, "truncated": 0}

    def timed(fn, name_of):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = name_of() if callable(name_of) else name_of
            stack.append([name, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                _, inner = stack.pop()
                acc[name] = acc.get(name, 0.0) + dt
                acc[name + "#excl"] = acc.get(name + "#excl", 0.0) + dt - inner
                if stack:
                    stack[-1][1] += dt
                    key = f"{name}@{stack[-1][0]}"  # time of this call inside its caller's phase
                    acc[key] = acc.get(key, 0.0) + dt
        return wrapper

    clock = {"t0": None, "last_end": None, "first_end": None}
    max_new = cfg["config"]["max_completion_length"]

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            acc.clear()
            tokens.update(n=0, samples=0, truncated=0)
            clock["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            step_s = now - clock["t0"]
            prep = acc.get("prepare", 0.0)
            gen_total = acc.get("gen_total", 0.0)
            # vLLM's sleep / KV-cache wake-up around generate count as sync, like ours (to_train, sync);
            # the weights' wake-up is inside sync_weights already
            sleepwake = acc.get("sleepwake", 0.0) - acc.get("sleepwake@sync", 0.0)
            sync_s = acc.get("sync", 0.0) + sleepwake
            rec = {
                "event": "step", "step": state.global_step, "step_s": step_s,
                "wall_s": now - clock["last_end"] if clock["last_end"] is not None else None,
                "generate": gen_total - sync_s, "sync": sync_s, "sleepwake": sleepwake,
                "weight_load": acc.get("sync", 0.0), "reward": acc.get("reward", 0.0),
                "logp": acc.get("logp_nograd", 0.0), "update": step_s - prep,
                "prepare": prep, "train_logp_fwd": acc.get("logp_grad", 0.0),
                "tokens": tokens["n"], "samples": tokens["samples"],
                "mean_len": tokens["n"] / max(tokens["samples"], 1),
                "truncated": tokens["truncated"] / max(tokens["samples"], 1),
                "since_start_s": time.time() - t_start,
            }
            rec["other"] = prep - (rec["generate"] + rec["sync"] + rec["reward"] + rec["logp"])
            if clock["first_end"] is None:
                clock["first_end"] = time.time() - t_start
                opt = kw.get("optimizer")
                rec["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__ if opt is not None else None
                if torch.cuda.is_available():
                    rec["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
            clock["last_end"] = now
            emit(rec)

    t = time.time()
    trainer = GRPOTrainer(model=cfg["model"], reward_funcs=[trl_letters], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepClock()])
    emit({"event": "built", "seconds": time.time() - t, "model_dtype": str(trainer.model.dtype),
          "model_device": str(trainer.model.device)})

    # phase timers: wrap the trainer's own methods (instance attributes shadow the class's)
    trainer._prepare_inputs = timed(trainer._prepare_inputs, "prepare")
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward")
    trainer._get_per_token_logps_and_entropies = timed(
        trainer._get_per_token_logps_and_entropies,
        lambda: "logp_grad" if torch.is_grad_enabled() else "logp_nograd")
    gen = trainer._generate_single_turn

    @functools.wraps(gen)
    def gen_counted(*args, **kwargs):
        completion_ids, logprobs = gen(*args, **kwargs)
        tokens["n"] += sum(len(c) for c in completion_ids)
        tokens["samples"] += len(completion_ids)
        tokens["truncated"] += sum(1 for c in completion_ids if len(c) >= max_new)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed(gen_counted, "gen_total")
    if cfg["use_vllm"]:
        vg_obj = trainer.vllm_generation
        vg_obj.sync_weights = timed(vg_obj.sync_weights, "sync")
        if getattr(vg_obj, "llm", None) is not None:  # colocate: sleep / wake_up of the engine
            vg_obj.llm.sleep = timed(vg_obj.llm.sleep, "sleepwake")
            vg_obj.llm.wake_up = timed(vg_obj.llm.wake_up, "sleepwake")

    t = time.time()
    trainer.train()
    emit({"event": "done", "train_seconds": time.time() - t, "first_step_end_s": clock["first_end"],
          "total_seconds": time.time() - t_start})
    sys.stdout.flush()
    os._exit(0)  # skip engine/process-group teardown: the figures are written


# ----------------------------------------------------------------------------- running a side


def child_env(extra: dict) -> dict:
    env = dict(os.environ)
    for k, v in CHILD_ENV.items():
        env.setdefault(k, v)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a single process: accelerate must not think it was launched distributed
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_side(label: str, cmd: list[str], env: dict, timeout: float, log_path: Path,
             done: Optional[Any] = None, grace: float = 3.0) -> dict:
    """Run a side's process with its output streamed (prefixed) and saved; stop it on timeout or
    when ``done()`` says its figures are complete. Returns how it ended."""
    tag = f"{label}{os.getpid()}x{int(time.time())}"
    env = {**env, "E2E_SIDE_TAG": tag}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    say(f"[{label}] start, timeout {timeout:.0f} s: {' '.join(shlex.quote(c) for c in cmd)}")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)

    def pump():
        with open(log_path, "wb") as log:
            for line in iter(p.stdout.readline, b""):
                log.write(line)
                log.flush()
                sys.stdout.write(f"[{label}] " + line.decode(errors="replace"))
                sys.stdout.flush()

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    how = None
    done_at = None
    while how is None:
        rc = p.poll()
        if rc is not None:
            how = f"exit {rc}"
        elif time.time() - t0 > timeout:
            how = "timeout"
        elif done is not None and done():
            done_at = done_at or time.time()
            if time.time() - done_at >= grace:
                how = "stopped after its last step"
        if how is None:
            time.sleep(0.5)
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    killed = kill_tagged("E2E_SIDE_TAG", tag)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    th.join(timeout=5)
    out = {"how": how, "rc": p.returncode, "seconds": time.time() - t0, "killed": killed, "log": str(log_path)}
    say(f"[{label}] ended: {how} after {out['seconds']:.0f} s")
    return out


def wait_gpu_free(limit_s: float = 30.0, below_mib: int = 3000) -> Optional[float]:
    """Wait until the GPU's used memory falls below ``below_mib`` (the last side's processes gone)."""
    t0 = time.time()
    used = None
    while time.time() - t0 < limit_s:
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
            used = max(float(x) for x in r.stdout.split())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        if used < below_mib:
            return used
        time.sleep(1)
    return used


def tail(path: str, n: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- report


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in VERSION_PKGS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        out["gpu"] = r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = None
    out["python"] = sys.version.split()[0]
    return out



def with_status(out: dict, done: int, n: int, end: dict, label: str) -> dict:
    """``out`` with its side's status line; a side that fell short prints its log's last lines."""
    if done >= n:
        out["status"] = f"ok, {done} steps"
    else:
        out["status"] = f"FAILED ({end['how']}) after {done} of {n} steps; log {end['log']}"
        say(f"[{label}] last lines:\n{tail(end['log'])}")
    return out

def summarize(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:]
    out: dict[str, Any] = {"timed_steps": len(timed), "all_steps": len(steps)}
    if not timed:
        return out
    for ph in PHASES:
        key = "step_s" if ph == "step" else ph
        vals = [float(s[key]) for s in timed if s.get(key) is not None]
        if vals:
            out[ph] = statistics.mean(vals)
            out[ph + "_median"] = statistics.median(vals)
    out["tokens"] = statistics.mean(float(s.get("tokens", 0.0)) for s in timed)
    out["mean_len"] = statistics.mean(float(s.get("mean_len", 0.0)) for s in timed)
    out["truncated"] = statistics.mean(float(s.get("truncated", 0.0)) for s in timed)
    if out.get("step"):
        out["tokens_per_s"] = out["tokens"] / out["step"]
    for k in ("reference_s", "old_logp_s", "mfu", "fwd_bwd_mfu", "optimizer_s", "mismatch"):  # ours only
        vals = [float(s[k]) for s in timed if s.get(k) is not None]
        if vals:
            out[k] = statistics.mean(vals)
            out[k + "_median"] = statistics.median(vals)
    out.update(paired_passes(timed))
    out["step_times"] = [round(float(s["step_s"]), 3) for s in timed]
    out["warmup_step_times"] = [round(float(s["step_s"]), 3) for s in steps[:warmup]]
    if any(s.get("compiled_graphs") is not None for s in steps):  # ours: each step's update and its compiles
        out["update_times"] = [round(float(s.get("update", 0.0)), 3) for s in steps]
        out["compiled_graphs"] = [int(s.get("compiled_graphs") or 0) for s in steps]
    return out


def paired_passes(timed: list[dict]) -> dict:
    """The reference pass against the policy's log-prob pass of the same step (same batch):
    ``{"ref_le_policy_steps": k, "paired_steps": n}``, empty when no step ran both."""
    pairs = [(float(s["reference_s"]), float(s["old_logp_s"])) for s in timed
             if s.get("reference_s") is not None and s.get("old_logp_s") is not None]
    if not pairs:
        return {}
    return {"ref_le_policy_steps": sum(r <= p for r, p in pairs), "paired_steps": len(pairs)}


def speedup(res: dict) -> Optional[float]:
    o, t = res["ours"].get("summary", {}).get("step"), res["trl"].get("summary", {}).get("step")
    return t / o if o and t else None


def fmt(x: Any, f: str = "{:.2f}") -> str:
    return "-" if x is None else f.format(x)


def report(a, res: dict) -> str:
    o, t = res["ours"].get("summary", {}), res["trl"].get("summary", {})
    trl_kind = res["trl"].get("kind", "vLLM colocate")
    lines = [
        f"e2e GRPO step, ours vs TRL GRPOTrainer ({trl_kind}): {a.preset} random, "
        f"{a.prompts_per_step} prompts x {a.group}, <= {a.max_new} new tokens, micro {a.micro} "
        f"({grad_accum(a)} accum), lr {a.lr:g}, KL {a.kl:g}, sleep ours {a.sleep} / TRL {a.trl_sleep}; "
        f"ours: ≤ {a.ours_tokens or 'auto (the plan)'} tokens per packed micro-batch, offload_train_state={a.offload}, "
        f"liger_kernels={a.liger}{' ' + a.ours_extra if a.ours_extra else ''}; TRL weights {a.trl_dtype}; "
        f"mean of steps {a.warmup + 1}..{total_steps(a)} ({a.warmup} warm-up)",
        "| phase (s) | ours | TRL | TRL/ours |",
        "| --- | --- | --- | --- |",
    ]
    for ph in PHASES:
        ratio = (t[ph] / o[ph]) if (o.get(ph) and t.get(ph) is not None and o[ph] > 1e-9) else None
        name = f"**{PHASE_DOC[ph]}**" if ph == "step" else PHASE_DOC[ph]
        lines.append(f"| {name} | {fmt(o.get(ph))} | {fmt(t.get(ph))} | {fmt(ratio)} |")
    sr = (t["step"] / o["step"]) if o.get("step") and t.get("step") else None
    sm = (t["step_median"] / o["step_median"]) if o.get("step_median") and t.get("step_median") else None
    tr = (o["tokens_per_s"] / t["tokens_per_s"]) if o.get("tokens_per_s") and t.get("tokens_per_s") else None
    lines += [
        f"| step, median | {fmt(o.get('step_median'))} | {fmt(t.get('step_median'))} | {fmt(sm)} |",
        f"| completion tokens / step | {fmt(o.get('tokens'), '{:.0f}')} | {fmt(t.get('tokens'), '{:.0f}')} | |",
        f"| mean completion length | {fmt(o.get('mean_len'), '{:.1f}')} | {fmt(t.get('mean_len'), '{:.1f}')} | |",
        f"| completion tokens / s (ours/TRL) | {fmt(o.get('tokens_per_s'), '{:.0f}')} | "
        f"{fmt(t.get('tokens_per_s'), '{:.0f}')} | {fmt(tr)} |",
        f"| start-up to first step end (s) | {fmt(res['ours'].get('first_step_s'), '{:.0f}')} | "
        f"{fmt(res['trl'].get('first_step_s'), '{:.0f}')} | |",
    ]
    if o:
        paired = (f"; reference ≤ policy in {o['ref_le_policy_steps']} of {o['paired_steps']} steps, medians "
                  f"{fmt(o.get('reference_s_median'))} / {fmt(o.get('old_logp_s_median'))} s"
                  if o.get("paired_steps") else "")
        lines.append(f"ours, passes: reference {fmt(o.get('reference_s'))} s, old log-prob pass "
                     f"{fmt(o.get('old_logp_s'))} s (none when the update is exactly on-policy{paired}), update MFU "
                     f"{fmt(o.get('mfu'), '{:.1%}')} (forward + backward alone {fmt(o.get('fwd_bwd_mfu'), '{:.1%}')}, "
                     f"optimizer steps {fmt(o.get('optimizer_s'))} s), "
                     f"trainer-vLLM log-prob mismatch {fmt(o.get('mismatch'), '{:.4f}')}")
    goal = "met" if sr is not None and sr >= GOAL else ("not met" if sr is not None else "not measured")
    lines.append(f"speed-up (TRL step / ours step, mean): {fmt(sr)} (goal >= {GOAL:g}: {goal})")
    for side in ("ours", "trl"):
        s = res[side]
        lines.append(f"{side}: {s.get('status', 'not run')}; steps {s.get('summary', {}).get('warmup_step_times', [])} "
                     f"(warm-up) {s.get('summary', {}).get('step_times', [])} (timed){compiles(s.get('summary', {}))}")
    if res["ours"].get("metrics_copy"):
        lines.append(f"ours' per-step metrics: {res['ours']['metrics_copy']}")
    ev = {e.get("event"): e for e in res["trl"].get("events", [])}
    if "imported" in ev:
        lines.append("trl side: " + json.dumps(ev["imported"].get("versions")))
    if "config" in ev:
        r = ev["config"].get("resolved", {})
        keys = ("generation_batch_size", "steps_per_generation", "optim", "bf16", "model_init_kwargs",
                "vllm_enable_sleep_mode", "vllm_importance_sampling_correction")
        lines.append("trl config: " + ", ".join(f"{k}={r.get(k)}" for k in keys))
    first = (res["trl"].get("steps") or [{}])[0]
    if first.get("optimizer") or first.get("peak_gib"):
        peak = fmt(first.get("peak_gib"), "{:.1f}")
        lines.append(f"trl optimizer {first.get('optimizer')}, peak reserved {peak} GiB")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plan / main


def plan(a) -> int:
    work = Path(a.work)
    prompts_file = str(work / "prompts.jsonl")
    ov = ours_overrides(a, a.model, prompts_file, str(work / "ours_run"))
    print("ours:", sys.executable, "-m rlhf.cli", " ".join(shlex.quote(x) for x in ov))
    # our spec's plan: the overrides must compose (the prompts file has to exist for data checks)
    if not Path(prompts_file).exists():
        write_prompts(Path(prompts_file), make_prompts(a.prompts_per_step * total_steps(a), a.prompt_words))
    r = subprocess.run([sys.executable, "-m", "rlhf.cli", *ov, "--plan"], cwd=ROOT, env=child_env({}))
    kw = trl_config_kwargs(a, str(work / "trl_out"), use_vllm=not a.cpu_test, cpu=a.cpu_test)
    print("trl: GRPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")")
    # the arguments must be accepted by the TRL that will run (in --trl-python)
    cfg_path = work / "trl_check.json"
    cfg_path.write_text(json.dumps({"config": kw}))
    rc_trl = subprocess.run([a.trl_python, "-m", "bench.e2e_trl", "--child", "trl-check", "--cfg", str(cfg_path)],
                            cwd=ROOT, env=child_env({})).returncode
    return r.returncode or rc_trl


def trl_check(cfg_path: str) -> int:
    """GRPOConfig(**the arguments) in this Python; on a machine without a GPU with bf16 off and
    use_cpu on (TrainingArguments refuses bf16 without a device that has it): for --plan."""
    kw = json.loads(Path(cfg_path).read_text())["config"]
    try:
        import torch
        from trl import GRPOConfig, __version__
    except ImportError as e:
        print(f"trl: not importable with {sys.executable} ({e}); its arguments were not checked "
              "(give --trl-python)")
        return 0
    if not torch.cuda.is_available():
        kw = dict(kw, use_cpu=True, bf16=False)
    try:
        c = GRPOConfig(**kw)
    except Exception as e:  # noqa: BLE001 - report any rejection
        print(f"trl {__version__}: GRPOConfig rejected the arguments: {type(e).__name__}: {e}")
        return 1
    print(f"trl {__version__}: GRPOConfig accepted: generation_batch_size={c.generation_batch_size} "
          f"steps_per_generation={c.steps_per_generation} optim={c.optim} bf16={c.bf16}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.child == "trl":
        return trl_child(a.cfg)
    if a.child == "trl-check":
        return trl_check(a.cfg)
    if a.plan:
        return plan(a)

    t_begin = time.time()
    deadline = t_begin + a.budget_s
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    vers = versions()
    say("versions " + json.dumps(vers))

    model = ensure_model(a)
    rows = make_prompts(a.prompts_per_step * total_steps(a), a.prompt_words)
    prompts_file = work / "prompts.jsonl"
    write_prompts(prompts_file, rows)
    lens = prompt_token_lengths(model, rows)
    say(f"{len(rows)} prompts, tokens min {min(lens)} mean {statistics.mean(lens):.1f} max {max(lens)} "
        f"(limit {a.max_prompt})")
    if max(lens) > a.max_prompt:
        say("WARNING some prompts exceed --max-prompt: our side drops them, TRL keeps them")

    samples = a.prompts_per_step * a.group
    res: dict[str, dict] = {"ours": {}, "trl": {}}
    sides = list(a.sides)
    for i, side in enumerate(sides):
        left = deadline - time.time() - 15
        share = left - a.side_reserve_s * (len(sides) - 1 - i)
        if share < 60:
            res[side] = {"status": f"skipped: {max(left, 0):.0f} s left"}
            say(f"[{side}] skipped, {left:.0f} s left")
            continue
        if i > 0 and not a.cpu_test:
            used = wait_gpu_free()
            say(f"GPU memory used before {side}: {used} MiB")
        if side == "ours":
            res["ours"] = run_ours(a, model, str(prompts_file), work, share, samples)
        else:
            res["trl"] = run_trl(a, model, str(prompts_file), work, share, deadline)

    table = report(a, res)
    print("\n" + table + "\n", flush=True)
    say("versions " + json.dumps(vers))
    summary = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("child", "cfg")},
        "versions": vers,
        "ours": res["ours"], "trl": res["trl"],
        "speedup_step_mean": speedup(res),
        "table": table,
    }
    try:
        from bench.checks import record, write_json_out

        record("e2e_trl", speedup=summary["speedup_step_mean"],
               ours={k: v for k, v in res["ours"].get("summary", {}).items()},
               trl={k: v for k, v in res["trl"].get("summary", {}).items()},
               ours_status=res["ours"].get("status"), trl_status=res["trl"].get("status"),
               trl_kind=res["trl"].get("kind"), versions=vers)
        write_json_out("bench_e2e_trl.json", summary)
    except Exception as e:  # noqa: BLE001 - the table above is the result; recording is a copy
        say(f"could not record results: {e}")
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    ok = all(res[s].get("summary", {}).get("timed_steps") for s in sides)
    return 0 if ok else 1


def run_ours(a, model: str, prompts_file: str, work: Path, timeout: float, samples: int) -> dict:
    run_dir = work / "ours_run"
    if run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
    metrics = run_dir / "metrics.jsonl"
    n = total_steps(a)
    device_gb = None if a.cpu_test or "hardware.device_memory_gb=" in a.ours_extra else gpu_total_gb()
    cmd = [sys.executable, "-m", "rlhf.cli", *ours_overrides(a, model, prompts_file, str(run_dir), device_gb)]
    t0 = time.time()
    first = {}

    def done() -> bool:
        rows = ours_rows(metrics)
        if rows and "t" not in first:
            first["t"] = time.time() - t0
        return len(rows) >= n

    end = run_side("ours", cmd, child_env({}), timeout, work / "ours.log", done=done)
    rows = ours_rows(metrics)
    steps = [ours_step(r, samples) for r in rows]
    out = {"end": end, "steps": steps, "summary": summarize(steps, a.warmup), "first_step_s": first.get("t")}
    if os.environ.get("OUT") and metrics.exists():  # the device call brings $OUT back: every metric of our run
        out["metrics_copy"] = str(Path(os.environ["OUT"]) / ours_metrics_name(a))
        shutil.copy(metrics, out["metrics_copy"])
    return with_status(out, len(steps), n, end, "ours")


def run_trl(a, model: str, prompts_file: str, work: Path, timeout: float, deadline: float) -> dict:
    use_vllm = not a.cpu_test
    out = _trl_once(a, model, prompts_file, work, timeout, use_vllm)
    out["kind"] = "vLLM colocate" if use_vllm else "HF generate (CPU test)"
    steps = out.get("steps", [])
    if use_vllm and not steps and a.trl_fallback == "hf":
        left = deadline - time.time() - 15
        if left >= 90:
            say(f"[trl] the vLLM path made no step ({out['status']}); rerunning with HF generate, "
                f"{left:.0f} s left")
            first = out
            out = _trl_once(a, model, prompts_file, work, left, use_vllm=False, suffix="_hf")
            out["kind"] = "HF generate, because the vLLM path failed"
            out["vllm_attempt"] = {k: first.get(k) for k in ("status", "end", "events")}
        else:
            out["status"] += f"; no time for the HF-generate fallback ({left:.0f} s left)"
    return out


def _trl_once(a, model: str, prompts_file: str, work: Path, timeout: float, use_vllm: bool,
              suffix: str = "") -> dict:
    result = work / f"trl_steps{suffix}.jsonl"
    result.unlink(missing_ok=True)
    extra = {}
    if use_vllm and a.trl_vllm_args == "same" and os.environ.get("RLHF_VLLM_ARGS"):
        extra = json.loads(os.environ["RLHF_VLLM_ARGS"])
    cfg = {
        "model": model, "prompts": prompts_file, "result": str(result), "use_vllm": use_vllm,
        "vllm_extra": extra,
        "config": trl_config_kwargs(a, str(work / f"trl_out{suffix}"), use_vllm=use_vllm, cpu=a.cpu_test),
    }
    cfg_path = work / f"trl_cfg{suffix}.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    cmd = [a.trl_python, "-m", "bench.e2e_trl", "--child", "trl", "--cfg", str(cfg_path)]
    end = run_side("trl" + suffix, cmd, child_env({}), timeout, work / f"trl{suffix}.log")
    events = []
    if result.exists():
        for line in result.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    steps = [e for e in events if e.get("event") == "step"]
    n = total_steps(a)
    out = {"end": end, "steps": steps, "summary": summarize(steps, a.warmup),
           "events": [e for e in events if e.get("event") != "step"],
           "first_step_s": steps[0]["since_start_s"] if steps else None}
    return with_status(out, len(steps), n, end, f"trl{suffix}")


if __name__ == "__main__":
    sys.exit(main())
