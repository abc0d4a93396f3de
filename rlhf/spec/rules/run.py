"""What a run writes and when: the tracking, checkpoint and eval sections, and ``mode``."""

from __future__ import annotations

import re
from typing import Any, Optional

from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import choice


def problems(s: Sections) -> list[str]:
    """tracking.*, checkpoint.keep_last / every / push_to_hub, eval.*, mode."""
    ck, p = s["checkpoint"], []
    p.extend(tracking_problems(s["tracking"]))
    p.extend(hub_repo_problems(ck.push_to_hub))
    if ck.keep_last < 1:
        p.append(f"checkpoint.keep_last={ck.keep_last} must be >= 1.")
    if ck.every < 0:
        p.append(f"checkpoint.every={ck.every} must be >= 0 (0 = only at the end).")
    p.extend(eval_problems(s))
    choice(p, "mode", s["mode"], ("run", "plan"))
    return p


def tracking_problems(t: Any) -> list[str]:
    """tracking.backend (one tracker or a list), tracking.console, tracking.wandb.mode."""
    from rlhf.spec.schema import TRACKERS, tracking_backends

    p: list[str] = []
    bad = [b for b in tracking_backends(t.backend) if b not in TRACKERS]
    if bad or not isinstance(t.backend, (str, list, tuple)):
        p.append(f"tracking.backend={t.backend!r} is not valid. Choose from: {', '.join(TRACKERS)}, none "
                 "(several as a list: tracking.backend=[mlflow,tensorboard]).")
    choice(p, "tracking.console", t.console, ("rich", "plain", "verbose", "none"))
    if t.wandb.mode not in (None, "online", "offline"):
        p.append(f"tracking.wandb.mode={t.wandb.mode!r} is not valid. Choose one of: online, offline "
                 "(or leave it null: WANDB_MODE decides).")
    return p


def hub_repo_problems(repo: Optional[str]) -> list[str]:
    """checkpoint.push_to_hub: a Hub repo id (org/name) or null."""
    if repo is not None and not re.fullmatch(r"([\w.-]+/)?[\w.-]{1,96}", repo):
        return [f"checkpoint.push_to_hub={repo!r} is not a Hub repo id. Use org/name (letters, digits, '-', '_', '.')."]
    return []


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
