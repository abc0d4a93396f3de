"""What a run writes and when: the tracking, checkpoint and eval sections, and ``mode``."""

from __future__ import annotations

from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import choice


def problems(s: Sections) -> list[str]:
    """tracking.backend / console, checkpoint.keep_last / every, eval.*, mode."""
    ck, p = s["checkpoint"], []
    choice(p, "tracking.backend", s["tracking"].backend, ("mlflow", "none"))
    choice(p, "tracking.console", s["tracking"].console, ("rich", "plain", "none"))
    if ck.keep_last < 1:
        p.append(f"checkpoint.keep_last={ck.keep_last} must be >= 1.")
    if ck.every < 0:
        p.append(f"checkpoint.every={ck.every} must be >= 0 (0 = only at the end).")
    p.extend(eval_problems(s))
    choice(p, "mode", s["mode"], ("run", "plan"))
    return p


def eval_problems(s: Sections) -> list[str]:
    """eval.*: how often, how many samples and prompts; an RL evaluation needs held-out prompts."""
    ev, p = s.get("eval"), []
    if ev is None:
        return p
    if ev.every < 0:
        p.append(f"eval.every={ev.every} must be >= 0 (0 = no evaluation).")
    if ev.n_samples < 1:
        p.append(f"eval.n_samples={ev.n_samples} must be >= 1.")
    if ev.max_prompts is not None and ev.max_prompts < 1:
        p.append(f"eval.max_prompts={ev.max_prompts} must be >= 1, or null for every eval prompt.")
    if ev.every > 0 and s["algo"].kind == "rl" and not s["data"].eval_files:
        p.append(f"eval.every={ev.every} but data.eval_files is empty: give held-out prompts, "
                 "e.g. data.eval_files=[builtin:keymap/eval], or set eval.every=0.")
    return p
