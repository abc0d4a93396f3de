"""End to end: a GRPO step of ours, TRL's, veRL's and OpenRLHF's, side by side on one GPU.

Extends ``bench/e2e_trl.py`` (BENCHMARKS.md §4) with two more sides on the same work: the same
random-weight model directory (``bench.make_model``), the same prompts, P prompts x G samples per
step, the same lengths, one optimizer step per GRPO step, token-mean loss, group-std advantages,
clip 0.2, lr 1e-6 constant, grad clip 1.0, KL off (``--kl c``: k3 in the loss on every side), vLLM
colocated with the same ``gpu_memory_utilization`` and sleep mode (``--sleep auto``: each side's
default — ours the plan's, TRL's and OpenRLHF's off, veRL's ``free_cache_engine`` on). Ours and TRL's run exactly as in
``bench.e2e_trl`` (its functions are called here). The peers:

* veRL (``python -m verl.trainer.main_ppo``, its default v1 sync trainer): ``algorithm.adv_estimator=grpo``,
  FSDP2 actor, vLLM rollout in its hybrid engine (async server mode, ``free_cache_engine`` = sleep),
  ``use_remove_padding`` and ``use_dynamic_bsz`` with our token budget per micro-batch
  (``--peer-batching tokens``; ``samples``: micro-batches of ``--micro`` samples), no gradient
  checkpointing, the CUDA-graph sizes of ours. Phase times: its own ``timing_s/*`` metrics.
* OpenRLHF (``python -m openrlhf.cli.train_ppo_ray``): ``--train.colocate_all`` (actor, reference,
  vLLM on one GPU), ``--algo.advantage.estimator group_norm``, DeepSpeed ZeRO-2 bf16,
  ``--ds.packing_samples`` with ``--train.dynamic_batch_enable`` at our token budget, vLLM sleep
  (``--vllm.enable_sleep``; DeepSpeed's states stay resident like ours' plan keeps them), CUDA
  graphs on. Phase times: its own ``timing/*`` per step.

Both peers select ``flash_attention_2`` for their padding-free passes; flash-attn has no build for
this image, so ``bench/peers/shim`` (put on the peers' path only) answers those calls with
PyTorch's FlashAttention kernels (the varlen kernel our side uses). veRL 0.9.1 also patches a class
of trl 0.27 that the bundle's TRL 1.16 no longer has; ``bench/peers/verl_shim`` (on veRL's path
only) gives it a stand-in class (value-head models, never built in GRPO). Each side prints its
settings; a side that fails is reported with its log's last lines, and the others still run.

Start-up is long on a fresh machine (OpenRLHF: 325 s to its first step's end, of which about 170 s
vLLM's cold compile and CUDA-graph capture and 45 s DeepSpeed's start; BENCHMARKS.md §8), so four
sides do not fit one 600-s device call: each side's result is kept in ``--work``
(``side_<name>.json``) and ``--report`` prints the table of every side kept there, so that the
sides can run in successive calls on one warm machine (same model files, same prompts).

    python -m bench.e2e_peers                          # every side, in the order verl,openrlhf,ours,trl
    python -m bench.e2e_peers --sides verl,openrlhf    # some sides (e2e_trl's flags apply too)
    python -m bench.e2e_peers --plan                   # each side's command, nothing run
    python -m bench.e2e_peers --report                 # the table of the sides kept in --work
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from bench import e2e_trl as base

ROOT = base.ROOT
SHIM = ROOT / "bench" / "peers" / "shim"
SIDES = ("verl", "openrlhf", "ours", "trl")
LABEL = {"ours": "ours", "trl": "TRL", "verl": "veRL", "openrlhf": "OpenRLHF"}
GOAL_PEERS = 1.3  # issue 33: our step >= 1.3x veRL's and OpenRLHF's


def say(msg: str) -> None:
    base.say(msg)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.e2e_peers", add_help=False)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--peer-batching", choices=("tokens", "samples"), default="tokens",
                    help="peers' micro-batches: by our token budget (--ours-tokens; their dynamic batch) or --micro samples")
    ap.add_argument("--peer-site", default=os.environ.get("PEER_SITE", "/tmp/peers/site"),
                    help="the peers' own site dir (installed there with --no-deps)")
    ap.add_argument("--peer-tokens", type=int, default=0,
                    help="the peers' token budget per micro-batch with --peer-batching tokens (0: --ours-tokens); "
                         "OpenRLHF's LM head materializes fp32 logits, so at 1.5B it needs <= 16,384 where ours runs 32,768")
    ap.add_argument("--side-cap-s", type=float, default=420, help="most seconds one side may run")
    ap.add_argument("--report", action="store_true",
                    help="print the table of the sides kept in --work by earlier runs (side_<name>.json); run nothing")
    ap.add_argument("--verl-fused", choices=("true", "false"), default="true",
                    help="veRL's actor_rollout_ref.model.use_fused_kernels (its fused log-prob/entropy head; its "
                         "docs' setting for speed)")
    ap.add_argument("--verl-extra", default="", help="more veRL hydra overrides (space separated)")
    ap.add_argument("--openrlhf-extra", default="", help="more OpenRLHF flags (space separated)")
    ap.add_argument("-h", "--help", action="store_true")
    own, rest = ap.parse_known_args(argv)
    if own.help:
        ap.print_help()
        print("\nand bench.e2e_trl's flags:")
        base.parse_args(["--help"])
    a = base.parse_args(["--sides", "ours,trl", *rest])
    for k, v in vars(own).items():
        setattr(a, k.replace("-", "_"), v)
    a.sides = [s for s in own.sides.split(",") if s]
    if own.peer_tokens < 0:
        ap.error(f"--peer-tokens {own.peer_tokens}: give a token budget > 0, or 0 for --ours-tokens")
    if a.peer_batching == "tokens" and not peer_tokens(a) and {"verl", "openrlhf"} & set(a.sides):
        ap.error("--ours-tokens 0 leaves the peers no token budget: give --peer-tokens N, or --peer-batching samples")
    bad = [s for s in a.sides if s not in SIDES]
    if bad:
        ap.error(f"--sides: unknown {bad}; use {','.join(SIDES)}")
    return a


# ----------------------------------------------------------------------------- shared inputs


def peer_tokens(a) -> int:
    """The peers' micro-batch token budget: --peer-tokens, else ours."""
    return a.peer_tokens or a.ours_tokens


def this_call() -> dict:
    """Where a side ran: one id per harness invocation, and the machine (host, boot id), so that a
    --report over sides from separate calls says so instead of passing them off as one run."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return {"id": f"{os.getpid()}-{time.time_ns()}", "host": os.uname().nodename, "boot": boot}


def micro_batch(a, side: str) -> str:
    """What bounds a side's micro-batches in this call (recorded with the side: a --report over sides
    from separate calls prints each side's own, not the reporting call's)."""
    if side == "ours":
        return f"<= {a.ours_tokens} tokens" if a.ours_tokens else "the plan's token budget"
    if side == "trl" or a.peer_batching != "tokens":
        return f"{a.micro} samples"
    return f"<= {peer_tokens(a)} tokens"


def calls_of(res: dict, sides: list[str]) -> int:
    """How many separate calls the shown sides come from (a side saved without one counts as its own)."""
    return len({(res[s].get("call") or {}).get("id") or s for s in sides})


def verl_parquet(rows: list[dict], path: Path) -> None:
    """veRL's RL dataset: a chat-format prompt per row (veRL applies the tokenizer's chat template),
    the reward's fields (the reward ignores them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [{"data_source": "bench", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, r in enumerate(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(recs), path)


def peer_env(a, first: tuple = ()) -> dict:
    """The peers' processes (and their Ray workers, which inherit it): ``first``, their own site dir,
    then the flash_attn stand-in, then the bundle and the project."""
    env = base.child_env({})
    parts = [*first, a.peer_site, str(SHIM)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["WANDB_MODE"] = "disabled"
    env["RAY_DEDUP_LOGS"] = "0"
    return env


def capture_sizes() -> Optional[list[int]]:
    extra = json.loads(os.environ.get("RLHF_VLLM_ARGS") or "{}")
    return (extra.get("compilation_config") or {}).get("cudagraph_capture_sizes")


# ----------------------------------------------------------------------------- veRL


def padded_tokenizer(model: str, out: Path) -> Path:
    """The model's tokenizer with filler tokens appended up to the model's ``vocab_size``, saved in ``out``
    (kept across calls). veRL masks vLLM's logits from ``len(tokenizer)`` up
    (``verl/workers/rollout/vllm_rollout/utils.py``, no setting turns it off): with the bench's 585-token
    tokenizer and a 151,936-row head its rollout would sample from 585 ids and report log-probs
    ln(151936/585) = 5.56 above its trainer's (the twelfth session's "mismatch", BENCHMARKS §8). Padded,
    the mask covers nothing and veRL samples the same distribution as the other sides; the ids of
    every real token are unchanged."""
    from transformers import AutoConfig, AutoTokenizer

    want = int(AutoConfig.from_pretrained(model).vocab_size)
    if (out / "tokenizer_config.json").exists() and len(AutoTokenizer.from_pretrained(out)) == want:
        return out
    tok = AutoTokenizer.from_pretrained(model)
    fill = want - len(tok)
    if fill > 0:
        tok.add_tokens([f"<|bench_fill_{i}|>" for i in range(fill)])
    tok.save_pretrained(out)
    return out


def verl_overrides(a, model: str, data: str, work: Path) -> list[str]:
    n = base.total_steps(a)
    tokens = peer_tokens(a)
    ov = [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"data.train_batch_size={a.prompts_per_step}",
        f"data.max_prompt_length={a.max_prompt}",
        f"data.max_response_length={a.max_new}",
        "data.filter_overlong_prompts=false",
        "data.truncation=error",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.tokenizer_path={work / 'verl_tokenizer'}",  # padded_tokenizer(model, ...)
        f"actor_rollout_ref.model.use_fused_kernels={a.verl_fused}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={a.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts_per_step}",  # one optimizer step per GRPO step
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={a.group}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={a.gpu_util}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        # --sleep auto: each side's default, veRL's free_cache_engine=true
        f"actor_rollout_ref.rollout.free_cache_engine={'false' if a.sleep == 'off' else 'true'}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={n}",
        "trainer.project_name=rlhf_bench",
        "trainer.experiment_name=e2e_peers",
        f"trainer.default_local_dir={work / 'verl_ckpt'}",
        f"reward.custom_reward_function.path={ROOT / 'bench' / 'peers' / 'reward_verl.py'}",
        "reward.custom_reward_function.name=compute_score",
    ]
    sizes = capture_sizes()
    if sizes:
        ov.append("actor_rollout_ref.rollout.cudagraph_capture_sizes=[" + ",".join(map(str, sizes)) + "]")
    if a.peer_batching == "tokens":
        ov += ["actor_rollout_ref.actor.use_dynamic_bsz=true",
               f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
               f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={tokens}",
               f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={tokens}"]
    else:
        ov += ["actor_rollout_ref.actor.use_dynamic_bsz=false",
               f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.micro}",
               f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={a.micro}",
               f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={a.micro}"]
    if a.kl > 0:
        ov += ["actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_coef={a.kl}",
               "actor_rollout_ref.actor.kl_loss_type=k3"]
    else:
        ov += ["actor_rollout_ref.actor.use_kl_loss=false"]
    return ov + shlex.split(a.verl_extra)


_VERL_STEP = re.compile(r"step:(\d+) - (.*)$")


def verl_steps(log: Path, samples: int) -> list[dict]:
    """veRL's console logger: one ``step:N - key:value - ...`` line per step."""
    out = []
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        m = _VERL_STEP.search(line)
        if not m or "timing_s/step" not in line:
            continue
        kv = {}
        for part in m.group(2).split(" - "):
            k, _, v = part.partition(":")
            try:
                kv[k.strip()] = float(v)
            except ValueError:
                pass
        t = lambda k: kv.get(f"timing_s/{k}", 0.0)  # noqa: E731
        rec = {"step": int(m.group(1)), "step_s": t("step"), "generate": t("gen"), "reward": t("reward"),
               "logp": t("old_log_prob") + t("ref"), "update": t("update_actor"), "sync": t("update_weights"),
               "adv": t("adv"), "old_logp_s": t("old_log_prob"), "reference_s": kv.get("timing_s/ref")}
        rec["other"] = rec["step_s"] - sum(rec[p] for p in ("generate", "reward", "logp", "update", "sync"))
        mean_len = kv.get("response_length/mean", 0.0)
        rec.update(mean_len=mean_len, tokens=mean_len * samples, truncated=kv.get("response_length/clip_ratio") or 0.0,
                   reward_mean=kv.get("critic/score/mean"), raw={k: v for k, v in kv.items() if k.startswith(
                       ("timing_s/", "perf/", "response_length/", "actor/", "rollout_corr/", "training/"))})
        out.append(rec)
    return out


def run_verl(a, model: str, rows: list[dict], work: Path, timeout: float, samples: int) -> dict:
    data = work / "verl_prompts.parquet"
    verl_parquet(rows, data)
    padded_tokenizer(model, work / "verl_tokenizer")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *verl_overrides(a, model, str(data), work)]
    log = work / "verl.log"
    n = base.total_steps(a)
    t0 = time.time()
    first: dict = {}

    def done() -> bool:
        s = verl_steps(log, samples)
        if s and "t" not in first:
            first["t"] = time.time() - t0
        return len(s) >= n

    end = base.run_side("verl", cmd, peer_env(a, (str(ROOT / "bench" / "peers" / "verl_shim"),)), timeout, log, done=done)
    steps = verl_steps(log, samples)
    out = {"end": end, "steps": steps, "summary": base.summarize(steps, a.warmup), "first_step_s": first.get("t"),
           "settings": "python -m verl.trainer.main_ppo " + " ".join(verl_overrides(a, model, "<data>", work))}
    return base.with_status(out, len(steps), n, end, "verl")


# ----------------------------------------------------------------------------- OpenRLHF


def openrlhf_args(a, model: str, prompts_file: str, work: Path) -> list[str]:
    samples = a.prompts_per_step * a.group
    args = [
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
        "--reward.num_nodes", "1", "--reward.num_gpus_per_node", "1",
        "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
        "--train.colocate_all",
        "--vllm.gpu_memory_utilization", str(a.gpu_util),
        "--actor.model_name_or_path", model,
        "--reward.remote_url", str(ROOT / "bench" / "peers" / "reward_openrlhf.py"),
        "--data.prompt_dataset", prompts_file, "--data.input_key", "prompt",
        "--data.max_samples", str(a.prompts_per_step * base.total_steps(a)),
        "--rollout.batch_size", str(a.prompts_per_step),
        "--rollout.n_samples_per_prompt", str(a.group),
        "--train.batch_size", str(samples),  # one optimizer step per GRPO step
        "--train.micro_batch_size", str(a.micro), "--rollout.micro_batch_size", str(a.micro),
        "--train.max_epochs", "1", "--train.num_episodes", "1",
        "--data.max_len", str(a.max_prompt + a.max_new), "--rollout.max_new_tokens", str(a.max_new),
        "--rollout.temperature", "1.0", "--rollout.top_p", "1.0",
        "--algo.advantage.estimator", "group_norm",
        "--actor.eps_clip", "0.2", "--actor.loss_agg_mode", "token-mean",
        "--actor.adam.lr", str(a.lr), "--actor.adam.weight_decay", "0.0",
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", "--actor.max_norm", "1.0",
        "--ds.zero_stage", "2", "--ds.param_dtype", "bf16",
        "--ds.packing_samples", "--ds.attn_implementation", "flash_attention_2",
        # its fastest documented settings, as ours runs with its own (prefix caching: a group's 8 samples
        # are 8 requests of one prompt there; Liger's kernels: in the bundle)
        "--vllm.enable_prefix_caching", "--ds.use_liger_kernel",
        "--ckpt.output_dir", str(work / "openrlhf_out"), "--ckpt.path", str(work / "openrlhf_ckpt"),
        "--ckpt.save_steps", "-1", "--logger.logging_steps", "1", "--train.seed", "42",
    ]
    if a.sleep == "on":  # --sleep auto: OpenRLHF's default, no sleep
        args.append("--vllm.enable_sleep")
    if a.peer_batching == "tokens":
        args += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(peer_tokens(a)),
                 "--rollout.max_tokens_per_gpu", str(peer_tokens(a))]
    if a.kl > 0:
        args += ["--algo.kl.init_coef", str(a.kl), "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
                 "--train.colocate_actor_ref"]
    else:
        args += ["--algo.kl.init_coef", "0"]
    return args + shlex.split(a.openrlhf_extra)


_ORL_STEP = re.compile(r"Global step (\d+): (\{.*\})")


def _floats(text: str) -> dict:
    """The numbers of OpenRLHF's logged status dict (a Python repr); entries that are not plain numbers
    (tensors, lists, strings) are skipped."""
    try:
        d = ast.literal_eval(text)
        return {k: float(v) for k, v in d.items() if isinstance(v, (int, float))}
    except (ValueError, SyntaxError):
        return {k: float(v) for k, v in re.findall(r"'([^']+)': (-?[0-9.]+(?:e-?\d+)?)", text)}


def openrlhf_steps(log: Path, samples: int) -> list[dict]:
    out = []
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        m = _ORL_STEP.search(line)
        if not m:
            continue
        kv = _floats(m.group(2))
        t = lambda k: kv.get(f"timing/{k}", 0.0)  # noqa: E731
        rec = {"step": int(m.group(1)), "generate": t("generation"), "logp": t("make_experience"),
               "update": t("ppo_train"), "sync": t("broadcast"), "reward": 0.0}
        # its step_total is the sum of its four timers: the experience hand-off to the actor (a Ray
        # call), the rollout statistics and the logging between steps are in none of them
        rec["step_s"] = kv.get("timing/step_total", sum(rec[p] for p in ("generate", "logp", "update", "sync")))
        rec["other"] = rec["step_s"] - sum(rec[p] for p in ("generate", "logp", "update", "sync"))
        mean_len = kv.get("rollout/response_length_mean", 0.0)
        rec.update(mean_len=mean_len, tokens=mean_len * samples, truncated=kv.get("rollout/truncated_rate") or 0.0,
                   reward_mean=kv.get("rollout/reward_mean"), raw=kv)
        out.append(rec)
    return out


def run_openrlhf(a, model: str, prompts_file: str, work: Path, timeout: float, samples: int) -> dict:
    cmd = [sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *openrlhf_args(a, model, prompts_file, work)]
    log = work / "openrlhf.log"
    n = base.total_steps(a)
    t0 = time.time()
    first: dict = {}

    def done() -> bool:
        s = openrlhf_steps(log, samples)
        if s and "t" not in first:
            first["t"] = time.time() - t0
        return len(s) >= n

    env = peer_env(a)
    # OpenRLHF's actor went silent after "NCCL version" in both tenth-session starts without NCCL's INFO lines
    # (the ninth's passed) and passed in both starts with them (eleventh): keep them on; if the silence
    # comes back, the log says where it waits (BENCHMARKS §8)
    env.setdefault("NCCL_DEBUG", "INFO")
    end = base.run_side("openrlhf", cmd, env, timeout, log, done=done)
    steps = openrlhf_steps(log, samples)
    out = {"end": end, "steps": steps, "summary": base.summarize(steps, a.warmup), "first_step_s": first.get("t"),
           "settings": "python -m openrlhf.cli.train_ppo_ray " + " ".join(openrlhf_args(a, model, "<prompts>", work))}
    return base.with_status(out, len(steps), n, end, "openrlhf")


# ----------------------------------------------------------------------------- report


def report(a, res: dict) -> str:
    sides = [s for s in a.sides if res.get(s)]
    summ = {s: res[s].get("summary", {}) for s in sides}
    o = summ.get("ours", {})
    n_calls = calls_of(res, sides)
    where = "side by side on one GPU" if n_calls <= 1 else f"from {n_calls} separate calls (not one run)"
    # each side's own call's setting; a side saved before sides recorded it: this call's arguments
    batches = ", ".join(f"{LABEL[s]} {res[s].get('micro_batch') or micro_batch(a, s)}" for s in sides)
    lines = [
        f"e2e GRPO step, {where}: {a.preset} random, {a.prompts_per_step} prompts x {a.group}, "
        f"<= {a.max_new} new tokens, KL {a.kl:g}, lr {a.lr:g}, sleep {a.sleep}, vLLM gpu util {a.gpu_util}; "
        f"micro-batches: {batches}; mean of steps {a.warmup + 1}..{base.total_steps(a)} ({a.warmup} warm-up)",
        "| phase (s) | " + " | ".join(LABEL[s] for s in sides) + " |",
        "| --- |" + " --- |" * len(sides),
    ]
    for ph in base.PHASES:
        name = f"**{base.PHASE_DOC[ph]}**" if ph == "step" else base.PHASE_DOC[ph]
        lines.append(f"| {name} | " + " | ".join(base.fmt(summ[s].get(ph)) for s in sides) + " |")
    lines.append("| step, median | " + " | ".join(base.fmt(summ[s].get("step_median")) for s in sides) + " |")
    lines.append("| step / ours' step (mean) | " + " | ".join(
        base.fmt(summ[s]["step"] / o["step"]) if summ[s].get("step") and o.get("step") else "-" for s in sides) + " |")
    lines.append("| mean completion length | " + " | ".join(base.fmt(summ[s].get("mean_len"), "{:.1f}")
                                                        for s in sides) + " |")
    lines.append("| completion tokens / s | " + " | ".join(base.fmt(summ[s].get("tokens_per_s"), "{:.0f}")
                                                       for s in sides) + " |")
    lines.append("| start-up to first step end (s) | " + " | ".join(
        base.fmt(res[s].get("first_step_s"), "{:.0f}") for s in sides) + " |")
    for s in sides:
        lines.append(f"{LABEL[s]}: {res[s].get('status', 'not run')}; steps {summ[s].get('warmup_step_times', [])} "
                     f"(warm-up) {summ[s].get('step_times', [])} (timed){base.compiles(summ[s])}")
    for s in ("verl", "openrlhf"):
        if s in sides and o.get("step") and summ[s].get("step"):
            r = summ[s]["step"] / o["step"]
            lines.append(f"speed-up vs {LABEL[s]} (its step / ours, mean): {r:.2f} "
                         f"(goal >= {GOAL_PEERS:g}: {'met' if r >= GOAL_PEERS else 'not met'}"
                         f"{'' if n_calls <= 1 else '; across calls, not a one-run ratio'})")
    return "\n".join(lines)


def settings_lines(a, model: str, prompts_file: str, work: Path) -> list[str]:
    out = []
    for s in a.sides:
        if s == "ours":
            out.append("ours: python -m rlhf.cli " + " ".join(base.ours_overrides(a, model, prompts_file, "<run>")))
        elif s == "trl":
            kw = base.trl_config_kwargs(a, "<out>", use_vllm=True, cpu=False)
            out.append("trl: GRPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")")
        elif s == "verl":
            out.append("verl: python -m verl.trainer.main_ppo " + " ".join(verl_overrides(a, model, "<data>", work)))
        elif s == "openrlhf":
            out.append("openrlhf: python -m openrlhf.cli.train_ppo_ray "
                       + " ".join(openrlhf_args(a, model, "<prompts>", work)))
    return out


def keep_side_log(work: Path, side: str) -> Optional[Path]:
    """The side's log, gzipped into $OUT as ``<E2E_TAG>_<side>.log.gz`` as soon as the side ends, so
    that a call its outer timeout ends still brings back the sides that ran (none without $OUT)."""
    log, out = work / f"{side}.log", os.environ.get("OUT")
    if not out or not log.exists():
        return None
    dest = Path(out) / f"{os.environ.get('E2E_TAG') or 'e2e'}_{side}.log.gz"
    with log.open("rb") as src, gzip.open(dest, "wb") as gz:
        shutil.copyfileobj(src, gz)
    return dest


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.plan:
        for line in settings_lines(a, a.model, str(work / "prompts.jsonl"), work):
            print(line)
        return 0
    if a.report:
        res = {s: json.loads((work / f"side_{s}.json").read_text()) for s in a.sides
               if (work / f"side_{s}.json").exists()}
        a.sides = [s for s in a.sides if s in res]
        for r in res.values():  # again with this call's --warmup (--warmup 0: every step a side made)
            r["summary"] = base.summarize(r.get("steps", []), a.warmup)
        print(report(a, res))
        return 0
    # --budget-s counts from the device call's start where bench/peers/device.sh says when that was:
    # its install steps come before this process, and the call's outer timeout is what ends it
    t_begin = float(os.environ.get("E2E_CALL_STARTED") or time.time())
    deadline = t_begin + a.budget_s
    if time.time() - t_begin > 1:
        say(f"the call started {time.time() - t_begin:.0f} s before this harness: the budget counts from then")
    vers = base.versions()
    say("versions " + json.dumps(vers))
    model = base.ensure_model(a)
    rows = base.make_prompts(a.prompts_per_step * base.total_steps(a), a.prompt_words)
    prompts_file = work / "prompts.jsonl"
    base.write_prompts(prompts_file, rows)
    lens = base.prompt_token_lengths(model, rows)
    say(f"{len(rows)} prompts, tokens min {min(lens)} mean {statistics.mean(lens):.1f} max {max(lens)}")
    for line in settings_lines(a, model, str(prompts_file), work):
        say("settings " + line)
    samples = a.prompts_per_step * a.group
    call = this_call()
    res: dict[str, dict] = {}
    for i, side in enumerate(a.sides):
        left = deadline - time.time() - 15
        share = min(a.side_cap_s, left - a.side_reserve_s * (len(a.sides) - 1 - i))
        if share < 60:
            res[side] = {"status": f"skipped: {max(left, 0):.0f} s left"}
            say(f"[{side}] skipped, {left:.0f} s left")
            continue
        if i > 0:
            say(f"GPU memory used before {side}: {base.wait_gpu_free()} MiB")
        if side == "ours":
            res[side] = base.run_ours(a, model, str(prompts_file), work, share, samples)
        elif side == "trl":
            res[side] = base.run_trl(a, model, str(prompts_file), work, share, deadline)
        elif side == "verl":
            res[side] = run_verl(a, model, rows, work, share, samples)
        else:
            res[side] = run_openrlhf(a, model, str(prompts_file), work, share, samples)
        res[side]["call"] = call
        res[side]["micro_batch"] = micro_batch(a, side)
        say(f"[{side}] {res[side].get('status')}")
        (work / f"side_{side}.json").write_text(json.dumps(res[side], default=str))
        keep_side_log(work, side)
    table = report(a, res)
    print("\n" + table + "\n", flush=True)
    say("versions " + json.dumps(vers))
    summary = {"settings": {k: v for k, v in vars(a).items() if k not in ("child", "cfg")}, "versions": vers,
               "sides": res, "table": table}
    out_dir = Path(os.environ.get("OUT") or work)
    (out_dir / f"e2e_peers_{a.preset}_{a.max_new}_kl{a.kl:g}.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(res.get(s, {}).get("summary", {}).get("timed_steps") for s in a.sides) else 1


if __name__ == "__main__":
    sys.exit(main())
