"""The plan's `auto` choices over a grid of model × hardware × algorithm × response length × KL, built
on this machine as `rlhf-run ... --plan` builds them (nothing starts): a review aid for changes to
rlhf/plan/auto.py. Save the grid before a change, then compare after it:

    python -m bench.plan_grid --out /tmp/before.json                 # on the old commit
    python -m bench.plan_grid --base /tmp/before.json                # on the new one: the cells that changed
    python -m bench.plan_grid --base /tmp/before.json placement=disaggregated   # extra overrides for every cell

Each cell's choices are what the build decided (`RunSpec.auto`: the token budget, ZeRO stage,
offloads, kernels, vLLM's sleep, engines per GPU, ...); a cell that does not build keeps the first
line of its error. Twenty-eighth session (BENCHMARKS §8): 51 of the default 192 cells moved
Adam's state from the host back to the GPU at a smaller budget.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Optional


def cell_overrides(model: str, hardware: str, algo: str, length: int, kl: float, extra: list[str]) -> list[str]:
    # model.path: no checkpoint needed, the model group's shape is planned
    return [*extra, f"model={model}", f"hardware={hardware}", f"algo={algo}", "model.path=/nonexistent",
            f"rollout.max_response_tokens={length}", "train.micro_batch_size=16", f"algo.kl.coef={kl:g}"]


def choices(overrides: list[str]) -> dict | str:
    """Every value the build decided for ``overrides`` (``RunSpec.auto``: key -> value), or the first
    line of why it does not build."""
    from rlhf.cli import build_spec, compose

    try:
        spec = build_spec(compose(overrides), overrides, plan=True)
    except Exception as e:  # noqa: BLE001 - a cell the plan refuses is a result too
        return (str(e).splitlines() or [type(e).__name__])[0][:160]
    return {d.key: d.value for d in spec.auto}


def grid(models: list[str], hardware: list[str], algos: list[str], lengths: list[int], kls: list[float],
         extra: list[str]) -> dict[str, dict | str]:
    cells = {}
    for m, h, a, n, k in itertools.product(models, hardware, algos, lengths, kls):
        o = cell_overrides(m, h, a, n, k, extra)
        cells[" ".join(o)] = choices(o)
    return cells


def changed(base: dict, now: dict) -> list[str]:
    """One line per cell of ``now`` whose choices differ from ``base``'s, naming only what changed (a
    cell the base lacks, or that does not build on one side, is shown whole)."""
    lines = []
    for cell in sorted(now):
        a, b = base.get(cell, "(not in the base)"), now[cell]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            diff = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
        else:
            diff = f"{a} -> {b}"
        lines.append(f"{cell}: {diff}")
    return lines


def _list(kind: type):
    """An argparse type: comma-separated values of ``kind`` (a bad one is argparse's one-line error)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {kind.__name__} values") from None
    return parse


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=_list(str), default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b,llama3-8b")
    ap.add_argument("--hardware", type=_list(str), default="1xh100,1xh200,8xh100,2xh200")
    ap.add_argument("--algos", type=_list(str), default="grpo,ppo")
    ap.add_argument("--lengths", type=_list(int), default="256,512,1024", help="rollout.max_response_tokens values")
    ap.add_argument("--kl", type=_list(float), default="0,0.001", help="algo.kl.coef values")
    ap.add_argument("--out", help="write the grid's choices here (JSON)")
    ap.add_argument("--base", help="a grid saved with --out: print the cells that changed since")
    ap.add_argument("overrides", nargs="*", help="more overrides for every cell, e.g. placement=disaggregated")
    a = ap.parse_args(argv)
    now = grid(a.models, a.hardware, a.algos, a.lengths, a.kl, a.overrides)
    if a.out:
        Path(a.out).write_text(json.dumps(now, indent=1, default=str))
    refused = sum(isinstance(c, str) for c in now.values())
    if a.base:
        lines = changed(json.loads(Path(a.base).read_text()), json.loads(json.dumps(now, default=str)))
        print("\n".join(lines))
        print(f"{len(lines)} of {len(now)} cells changed ({refused} do not build)")
    else:
        print(f"{len(now)} cells planned ({refused} do not build)" + (f": {a.out}" if a.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
