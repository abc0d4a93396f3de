"""The data section (files, weights, lengths, column renames) and the reward section (functions,
a reward model, remote services)."""

from __future__ import annotations

from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import auto_bool


def problems(s: Sections) -> list[str]:
    """data.*: at least one file, a weight per file, room for a prompt and a response, old:new renames."""
    data, p = s["data"], []
    if not data.train_files:
        p.append("data.train_files is empty. Give at least one file, e.g. data.train_files=[path/to/train.jsonl].")
    if data.weights is not None and len(data.weights) != len(data.train_files):
        p.append(
            f"data.weights has {len(data.weights)} entries but data.train_files has {len(data.train_files)}: "
            "give one weight per file."
        )
    if data.max_length is not None and data.max_length < 2:
        p.append(f"data.max_length={data.max_length} leaves no room for a prompt and a response token. "
                 "Use 2 or more, or null (= rollout.max_prompt_tokens + rollout.max_response_tokens).")
    for i, c in enumerate(data.columns):
        old, _, new = c.partition(":")
        if not old or not new or ":" in new:
            p.append(f"data.columns[{i}]={c!r} must be old:new (a column to rename and its new name), "
                     "e.g. data.columns=[question:prompt].")
    return p


def reward_problems(s: Sections) -> list[str]:
    """reward.*: an RL run has a reward (functions, a model, a service or an environment); functions
    named module:function; a remote service's urls and limits."""
    rw, algo, p = s["reward"], s["algo"], []
    has_env = s.get("env") is not None and s["env"].fn is not None
    if algo.kind == "rl" and not rw.functions and not rw.model_path and rw.remote is None and not has_env:
        p.append("this RL run has no reward: set reward.functions (module:function), reward.model_path "
                 "or reward.remote.urls.")
    if rw.remote is not None:
        rr = rw.remote
        if not rr.urls:
            p.append("reward.remote.urls is empty: give at least one reward server, e.g. "
                     "reward.remote.urls=[http://127.0.0.1:8000] (start one with rlhf-reward-server).")
        for i, u in enumerate(rr.urls):
            if not (u.startswith("http://") or u.startswith("https://")):
                p.append(f"reward.remote.urls[{i}]={u!r} must start with http:// or https://.")
        for key in ("batch_size", "concurrency"):
            if getattr(rr, key) < 1:
                p.append(f"reward.remote.{key}={getattr(rr, key)} must be >= 1.")
        if rr.retries < 0:
            p.append(f"reward.remote.retries={rr.retries} must be >= 0.")
        if rr.timeout_s <= 0:
            p.append(f"reward.remote.timeout_s={rr.timeout_s} must be > 0.")
        names = {f.name or f.fn.rpartition(":")[2] for f in rw.functions}
        if rr.name in names:
            p.append(f"reward.remote.name={rr.name!r} is also a reward function's name: choose another.")
    for i, f in enumerate(rw.functions):
        if ":" not in f.fn:
            p.append(
                f"reward.functions[{i}].fn={f.fn!r} must name a function as module:function or "
                "path/to/file.py:function."
            )
    if rw.timeout_s <= 0:
        p.append(f"reward.timeout_s={rw.timeout_s} must be > 0.")
    auto_bool(p, "reward.isolate", rw.isolate, "your functions in a process of their own, the project's own in "
              "the driver")
    if rw.memory_gb is not None and rw.memory_gb < 0:
        p.append(f"reward.memory_gb={rw.memory_gb} must be >= 0 (0: no cap; null: half this machine's memory).")
    return p
