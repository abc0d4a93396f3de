"""A tiny synthetic arithmetic data set for GRPO on math-style prompts (``recipes/grpo_arith_*``).

Rows: ``{"prompt", "answer", "data_source"}``; ``data_source`` is the operation (arith_add,
arith_sub, arith_mul), so evaluation can report per source. The reward is
``rlhf.rewards.math:arith_reward`` (1.0 when the last number in the response is the answer).

    python -m rlhf.data.arith --out examples/arith     # train.jsonl (256 rows), eval.jsonl (64)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = {"add": ("+", lambda a, b: a + b), "sub": ("-", lambda a, b: a - b), "mul": ("*", lambda a, b: a * b)}


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice(sorted(OPS))
        sym, fn = OPS[op]
        a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "mul" else 12)
        rows.append({"prompt": f"What is {a} {sym} {b}? Think briefly, then give the final answer as a number.",
                     "answer": str(fn(a, b)), "data_source": f"arith_{op}"})
    return rows


def write(out: Path, n_train: int = 256, n_eval: int = 64, seed: int = 0) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 1)):
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in make_rows(n, s)))
        paths.append(p)
    return paths[0], paths[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="examples/arith")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for p in write(Path(a.out), a.train, a.eval, a.seed):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
