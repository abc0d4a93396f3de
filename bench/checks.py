"""Checks and result recording shared by the GPU tests and benchmarks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def out_dir() -> Path:
    d = Path(os.environ.get("RLHF_GPU_OUT", "/tmp/rlhf-gpu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def record(name: str, **fields) -> None:
    """Append one measured result (also printed, so it lands in the log)."""
    row = {"name": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **fields}
    print("RESULT " + json.dumps(row, default=str), flush=True)
    with open(out_dir() / "results.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def compare_greedy(vllm_tokens, hf_tokens, forced, tie_tol: float = 0.125) -> dict:
    """Exact equality per prompt, and whether each vLLM token is HF's argmax given vLLM's own
    prefix up to a bf16 near-tie (logit gap <= tie_tol)."""
    exact = [a == b for a, b in zip(vllm_tokens, hf_tokens)]
    consistent = [all(g <= tie_tol for g in f["gap"]) for f in forced]
    argmax_agree = sum(sum(1 for g in f["gap"] if g == 0.0) for f in forced)
    total = sum(len(f["gap"]) for f in forced)
    first_diff = []
    for a, b in zip(vllm_tokens, hf_tokens):
        first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    return {
        "prompts": len(exact),
        "exact_prompts": sum(exact),
        "consistent_prompts": sum(consistent),
        "forced_argmax_tokens": argmax_agree,
        "forced_tokens": total,
        "max_gap": max((max(f["gap"]) for f in forced if f["gap"]), default=0.0),
        "first_diff": first_diff,
    }


def digests_match(a: dict, b: dict, rel: float = 1e-6) -> bool:
    return (
        a["numel"] == b["numel"]
        and abs(a["sum"] - b["sum"]) <= rel * max(1.0, abs(b["sumsq"])) ** 0.5 * 10
        and abs(a["sumsq"] - b["sumsq"]) <= rel * abs(b["sumsq"])
    )


def write_json_out(name: str, obj) -> None:
    with open(out_dir() / name, "w") as f:
        json.dump(obj, f, indent=2, default=str)


def greedy_round(engine, trainer, prompts, new_tokens: int, label: str):
    """Greedy tokens of the vLLM engine against the trainer's (HF greedy and forced decoding of
    vLLM's tokens) and both sides' weight digests, recorded as ``greedy_<label>``: ``(comparison,
    vLLM tokens, trainer digest)``. ``engine`` and ``trainer`` are Ray actor handles."""
    import ray

    out = ray.get(engine.generate_ids.remote(prompts, max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    v = [x.response_ids for x in out]
    h = ray.get(trainer.greedy.remote(prompts, new_tokens))
    forced = ray.get(trainer.forced.remote(prompts, v))
    cmp = compare_greedy(v, h, forced)
    dv, dt = ray.get([engine.weight_digest.remote(), trainer.digest.remote()])
    cmp["digest_match"] = digests_match(dv, dt)
    record(f"greedy_{label}", **cmp)
    return cmp, v, dt
