"""`rlhf-data`: make synthetic data for the built-in task.

    rlhf-data make sft --out data/sft                    # train.jsonl + eval.jsonl
    rlhf-data make preference --out data/pref --n 1024
    rlhf-data make prompts --out data/prompts --seed 3

Then, e.g.:  rlhf-run algo=sft data.train_files=[data/sft/train.jsonl] data.eval_files=[data/sft/eval.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from rlhf.data.make import BUILTIN_SFT_NOISE, BUILTIN_SIZES, KINDS, make

EXAMPLE_RUN = {
    "sft": "rlhf-run algo=sft data.train_files=[{train}] data.eval_files=[{eval}]",
    "preference": "rlhf-run algo=dpo data.train_files=[{train}] data.eval_files=[{eval}]   (or algo=rm)",
    "prompts": "rlhf-run algo=grpo data.train_files=[{train}] data.eval_files=[{eval}]",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf-data", description="Synthetic data for the built-in keymap task.")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write train.jsonl and eval.jsonl under --out")
    m.add_argument("kind", choices=KINDS)
    m.add_argument("--out", required=True, help="output directory")
    sizes = ", ".join(f"{k} {t}/{e}" for k, (t, e) in BUILTIN_SIZES.items())
    m.add_argument("--n", type=int, default=None, help=f"training rows (default: as builtin:keymap-<kind>: {sizes})")
    m.add_argument("--n-eval", type=int, default=None, help="held-out rows (default: as builtin:keymap-<kind>)")
    m.add_argument("--seed", type=int, default=0, help="0 gives the same rows as builtin:keymap-<kind>")
    m.add_argument("--noise", type=float, default=None,
                   help=f"sft: chance that each answer word is replaced by a random value (default {BUILTIN_SFT_NOISE})")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    n_train, n_eval = BUILTIN_SIZES[args.kind]
    args.n = n_train if args.n is None else args.n
    args.n_eval = n_eval if args.n_eval is None else args.n_eval
    if args.kind == "sft" and args.noise is None:
        args.noise = BUILTIN_SFT_NOISE
    if args.n < 1 or args.n_eval < 1:
        print("error: --n and --n-eval must be >= 1", file=sys.stderr)
        return 2
    if args.noise is not None and not 0 <= args.noise <= 1:
        print("error: --noise must be in [0, 1]", file=sys.stderr)
        return 2
    paths = make(args.kind, args.out, n_train=args.n, n_eval=args.n_eval, seed=args.seed, noise=args.noise)
    print(f"wrote {args.n} rows to {paths['train']} and {args.n_eval} rows to {paths['eval']}")
    print("train with: " + EXAMPLE_RUN[args.kind].format(train=paths["train"], eval=paths["eval"]))
    return 0


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
