"""Synthetic SFT, preference and prompt data for the built-in ``keymap`` task.

    sft          {"prompt": "key k3 =", "response": "v5 v1 v6", "answer": "v5 v1 v6"}
                 each answer word is replaced by a random value word with probability ``noise``,
                 so a model trained on it is good but not perfect: RL after SFT has room to improve
    preference   {"prompt", "chosen", "rejected", "answer", "chosen_score", "rejected_score"}
                 two candidate responses with different true rewards (``rlhf.data.builtin.score``);
                 the better one is ``chosen``. Candidates mix near-misses (the answer with some
                 words wrong), wrong-length answers and random word salad, so that a reward model
                 trained on them also ranks the odd outputs an RL policy tries
    prompts      {"prompt", "answer"}: RL prompts, as the built-in data set

Everything is a pure function of (kind, n, seed, options); files are written as jsonl.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

from rlhf.data import builtin as task

KINDS = ("sft", "preference", "prompts")


def _key(rng: random.Random) -> str:
    return rng.choice(task.KEYS)


def noisy_answer(answer: list[str], n_wrong: int, rng: random.Random) -> list[str]:
    out = list(answer)
    for pos in rng.sample(range(len(out)), n_wrong):
        out[pos] = rng.choice([v for v in task.VALUES if v != answer[pos]])
    return out


def candidate(answer: list[str], rng: random.Random) -> str:
    """A response of some quality: mostly near-misses of the answer, sometimes odd shapes."""
    r = rng.random()
    if r < 0.6:  # the answer with 0..len wrong words
        words = noisy_answer(answer, rng.randint(0, len(answer)), rng)
    elif r < 0.75:  # too short or too long
        words = noisy_answer(answer, rng.randint(0, len(answer)), rng)
        words = words[: rng.randint(1, len(words) - 1)] if rng.random() < 0.5 else words + [rng.choice(task.VALUES)]
    elif r < 0.9:  # value words in random order
        words = [rng.choice(task.VALUES) for _ in range(rng.randint(1, len(answer) + 1))]
    else:  # anything from the vocabulary
        words = [rng.choice(task.WORDS) for _ in range(rng.randint(1, len(answer) + 1))]
    return " ".join(words)


def sft_rows(n: int, seed: int = 0, noise: float = 0.2) -> list[dict]:
    rng = random.Random(f"sft-{seed}")
    t = task.table()
    rows = []
    for _ in range(n):
        k = _key(rng)
        ans = t[k]
        words = [w if rng.random() >= noise else rng.choice(task.VALUES) for w in ans]
        rows.append({"prompt": task.prompt_for(k), "response": " ".join(words), "answer": " ".join(ans)})
    return rows


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"preference-{seed}")
    t = task.table()
    rows = []
    while len(rows) < n:
        k = _key(rng)
        ans = t[k]
        answer = " ".join(ans)
        a, b = candidate(ans, rng), candidate(ans, rng)
        sa, sb = task.score(a, answer), task.score(b, answer)
        if sa == sb:
            continue
        (c, sc), (r, sr) = sorted([(a, sa), (b, sb)], key=lambda x: -x[1])
        rows.append(
            {"prompt": task.prompt_for(k), "chosen": c, "rejected": r, "answer": answer, "chosen_score": sc, "rejected_score": sr}
        )
    return rows


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"prompts-{seed}")
    t = task.table()
    return [{"prompt": task.prompt_for(k), "answer": " ".join(t[k])} for k in (_key(rng) for _ in range(n))]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def make(kind: str, out: str | Path, *, n_train: int = 512, n_eval: int = 64, seed: int = 0, noise: Optional[float] = None) -> dict[str, Path]:
    """Write ``<out>/train.jsonl`` and ``<out>/eval.jsonl``; returns their paths. Train and eval
    rows come from different seeds."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    out = Path(out)
    paths = {}
    for split, n, s in (("train", n_train, seed), ("eval", n_eval, seed + 10_000)):
        if kind == "sft":
            rows = sft_rows(n, s, 0.2 if noise is None else noise)
        elif kind == "preference":
            rows = preference_rows(n, s)
        else:
            rows = prompt_rows(n, s)
        paths[split] = out / f"{split}.jsonl"
        write_jsonl(paths[split], rows)
    return paths
