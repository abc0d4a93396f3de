"""The report's panels: each a title, the metrics.jsonl series it draws, and how.

Series come from ``metrics.jsonl`` (one row per step); a panel whose series are all absent (the
entropy of an SFT run, GPU memory on CPU) is left out of the image and named in the page as absent.

* time per step by phase: the ``time/<phase>`` seconds stacked per step; an ``*_optimizer_step``
  time lies inside ``time/update`` (tests/rl/test_rl_runs.py), so it is taken out of the update's
  bar and stacked as its own phase. ``time/step`` is drawn over the bars: what the stack leaves
  out (bookkeeping between phases) is the gap.
* GPU memory: each ``memory/*_gib`` series (per-process peaks the workers measure) against the
  plan's figure for each phase or role (``rlhf.plan.memory.estimate``, GB converted to GiB),
  drawn as dashed lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhf.spec.runspec import RunSpec

# time/* keys that are not a phase of the step
NOT_PHASES = {"time/step", "time/elapsed", "time/total"}
MAX_LINES = 8  # series per panel; more are left out, the page lists them


@dataclass
class Panel:
    key: str  # its anchor in the page and its name in tests
    title: str
    ylabel: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    kind: str = "lines"  # lines | stacked | markers
    plan: dict[str, float] = field(default_factory=dict)  # memory: the plan's GiB per phase/role
    left_out: list[str] = field(default_factory=list)  # in the table, not in the image
    total: list[tuple[int, float]] = field(default_factory=list)  # stacked: the step's whole time

    @property
    def empty(self) -> bool:
        return not any(self.series.values())


def read_rows(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl's rows; a half-written last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and v == v:
            out.append((int(r.get("step", i)), float(v)))
    return out


def _pick(rows: list[dict], keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    return {k: s for k in keys if (s := series(rows, k))}


def _keys(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(r))
    return list(seen)


def _capped(panel: Panel, limit: int = MAX_LINES) -> Panel:
    """At most ``limit`` series drawn; the rest named in ``left_out`` (the page still tabulates them)."""
    if len(panel.series) > limit:
        names = list(panel.series)
        panel.left_out = names[limit:]
    return panel


def phase_times(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Seconds per phase per step, the optimizer steps taken out of the update (see the module doc)."""
    keys = [k for k in _keys(rows) if k.startswith("time/") and k not in NOT_PHASES and k != "time/eval"]  # eval: between steps
    opt = [k for k in keys if k.endswith("_optimizer_step")]
    out: dict[str, list[tuple[int, float]]] = {}
    for k in keys:
        if k in opt:
            continue
        pts = series(rows, k)
        if k == "time/update" and opt:
            inside: dict[int, float] = {}
            for o in opt:
                for step, v in series(rows, o):
                    inside[step] = inside.get(step, 0.0) + v
            pts = [(step, max(v - inside.get(step, 0.0), 0.0)) for step, v in pts]
            out["update (passes)"] = pts
            continue
        out[k[len("time/"):]] = pts
    for o in opt:
        out[o[len("time/"):].replace("_", " ")] = series(rows, o)
    return {k: v for k, v in out.items() if v}


def build_panels(rows: list[dict], plan_gib: Optional[dict[str, float]] = None) -> list[Panel]:
    keys = _keys(rows)
    evals = [k for k in keys if k.startswith("eval/") and not k.endswith("/prompts")
             and re.search(r"reward_mean|pass_at_\d+|pass_rate|accuracy|loss", k)]
    overall = [k for k in evals if re.fullmatch(r"eval/((greedy|sampled)/)?[^/]+", k)]
    per_source = [k for k in evals if k not in overall]  # eval/<data source>/...: in the page's table
    memory = [k for k in keys if k.startswith("memory/") and k.endswith("_gib") and "fraction" not in k]
    panels = [
        Panel("reward", "Reward", "reward", _pick(rows, ["reward/mean", "reward/min", "reward/max"])),
        Panel("kl", "KL to the reference", "KL", _pick(rows, ["kl/mean"])),
        Panel("response_length", "Response length", "tokens", _pick(rows, ["response/length_mean",
                                                                           "response/length_max"])),
        Panel("entropy", "Entropy", "nats/token", _pick(rows, ["actor/entropy"])),
        Panel("loss", "Training loss", "loss", _pick(rows, ["train/loss", "actor/pg_loss", "critic/loss"])),
        Panel("accuracy", "Training accuracy", "accuracy", _pick(rows, ["train/accuracy"])),
        _capped(Panel("eval", "Evaluation", "value", _pick(rows, overall + per_source), kind="markers"),
                len([k for k in overall if series(rows, k)]) or MAX_LINES),
        Panel("phase_time", "Time per step by phase", "seconds", phase_times(rows), kind="stacked",
              total=series(rows, "time/step")),
        Panel("throughput", "Throughput", "tokens/s", _pick(rows, ["throughput/tokens_per_s",
                                                                   "throughput/generate_tokens_per_s"])),
        _capped(Panel("gpu_memory", "GPU memory per process vs the plan", "GiB", _pick(rows, memory),
                      plan=dict(plan_gib or {}))),
    ]
    return panels


def plan_memory_gib(spec: RunSpec) -> dict[str, float]:
    """The plan's GiB per phase (hybrid) or role (disaggregated); {} off CUDA."""
    if spec.hardware.accelerator != "cuda":
        return {}
    from rlhf.plan.memory import GB, estimate

    return {name: total * GB / 2**30 for name, total in estimate(spec).totals.items()}
