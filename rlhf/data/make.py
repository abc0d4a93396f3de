"""Synthetic SFT, preference and prompt data for the built-in ``keymap`` task.

    sft          {"prompt": "key k3 k0 =", "response": "v5 v1", "answer": "v5 v1"}
                 each answer word is replaced by a random value word with probability ``noise``,
                 so a model trained on it is good but not perfect: RL after SFT has room to improve
    preference   {"prompt", "chosen", "rejected", "answer", "chosen_score", "rejected_score"}
                 two candidate responses with different true rewards (``rlhf.data.builtin.score``);
                 the better one is ``chosen``. Candidates mix near-misses (the answer with some
                 words wrong), wrong-length answers and random word salad, so that a reward model
                 trained on them also ranks the odd outputs an RL policy tries
    prompts      {"prompt", "answer"}: RL prompts, as the built-in data set

Everything is a pure function of (kind, n, seed, options); files are written as jsonl.

The same data is available without a make step as ``builtin:keymap-sft/train`` (and ``/eval``),
``builtin:keymap-preference/...`` and ``builtin:keymap-prompts/...``: generated on first use under
``cache_dir()/data/`` with the defaults below, like the built-in task's own files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

from rlhf.data import builtin as task
from rlhf.paths import cache_dir

KINDS = ("sft", "preference", "prompts")
VERSION = 4  # of the generators below: part of the cache folder name, with the task's VERSION
BUILTIN_SFT_NOISE = 0.35  # builtin:keymap-sft: imperfect demonstrations, so RL after SFT has room to improve
BUILTIN_SIZES = {"sft": (512, 128), "preference": (1024, 128), "prompts": (1024, 128)}  # (train, eval) rows


def task_row(rng: random.Random) -> tuple[str, list[str]]:
    """A prompt of the built-in task and its answer words."""
    keys = [rng.choice(task.KEYS) for _ in range(task.ANSWER_LEN)]
    return task.prompt_for(keys), task.answer_for(keys).split()


def noisy_answer(answer: list[str], n_wrong: int, rng: random.Random) -> list[str]:
    out = list(answer)
    for pos in rng.sample(range(len(out)), n_wrong):
        out[pos] = rng.choice([v for v in task.VALUES if v != answer[pos]])
    return out


def candidate(answer: list[str], rng: random.Random) -> str:
    """A response of some quality: mostly the answer's format with some words wrong (so a reward
    model has to learn the task, not the format), sometimes odd shapes an RL policy may try."""
    r = rng.random()
    if r < 0.7:  # the answer with 0..len wrong words
        words = noisy_answer(answer, rng.randint(0, len(answer)), rng)
    elif r < 0.8:  # too short or too long
        words = noisy_answer(answer, rng.randint(0, len(answer)), rng)
        if rng.random() < 0.5 and len(words) > 1:
            words = words[: rng.randint(1, len(words) - 1)]
        else:
            words = words + [rng.choice(task.VALUES)]
    elif r < 0.92:  # value words in random order
        words = [rng.choice(task.VALUES) for _ in range(rng.randint(1, len(answer) + 1))]
    elif r < 0.94:  # nothing (just the end of the response)
        words = []
    else:  # anything from the vocabulary
        words = [rng.choice(task.WORDS) for _ in range(rng.randint(1, len(answer) + 1))]
    return " ".join(words)


def sft_rows(n: int, seed: int = 0, noise: float = 0.2) -> list[dict]:
    rng = random.Random(f"sft-{seed}")
    rows = []
    for _ in range(n):
        prompt, ans = task_row(rng)
        words = [w if rng.random() >= noise else rng.choice(task.VALUES) for w in ans]
        rows.append({"prompt": prompt, "response": " ".join(words), "answer": " ".join(ans)})
    return rows


LOW_PAIR_SCORE = 0.75  # a pair whose better response scores below this is "both bad"
LOW_PAIR_KEEP = 0.1  # the share of "both bad" pairs kept


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"preference-{seed}")
    rows = []
    while len(rows) < n:
        prompt, ans = task_row(rng)
        answer = " ".join(ans)
        a, b = candidate(ans, rng), candidate(ans, rng)
        sa, sb = task.score(a, answer), task.score(b, answer)
        if sa == sb:
            continue
        if max(sa, sb) < LOW_PAIR_SCORE and rng.random() >= LOW_PAIR_KEEP:
            continue  # both bad: fewer of these, most pairs teach "right beats wrong"
        (c, sc), (r, sr) = sorted([(a, sa), (b, sb)], key=lambda x: -x[1])
        rows.append(
            {"prompt": prompt, "chosen": c, "rejected": r, "answer": answer, "chosen_score": sc, "rejected_score": sr}
        )
    return rows


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"prompts-{seed}")
    out = []
    for _ in range(n):
        prompt, ans = task_row(rng)
        out.append({"prompt": prompt, "answer": " ".join(ans)})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def make(kind: str, out: str | Path, *, n_train: int = 512, n_eval: int = 128, seed: int = 0,
         noise: Optional[float] = None) -> dict[str, Path]:
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


def builtin_file(name: str) -> Path:
    """``keymap-<kind>/<split>`` → its jsonl under the cache dir (made on first use, atomically)."""
    from rlhf.storage import atomic_dir
    from rlhf.spec.errors import UserError

    task_name, _, split = name.partition("/")
    kind = task_name[len("keymap-"):] if task_name.startswith("keymap-") else ""
    if kind not in KINDS or split not in ("train", "eval"):
        raise UserError(
            f"builtin:{name} is not a built-in data set. Use builtin:keymap/<train|eval> (RL prompts) or "
            "builtin:keymap-<sft|preference|prompts>/<train|eval>."
        )
    folder = cache_dir() / "data" / f"keymap-{kind}-v{VERSION}-t{task.VERSION}"
    with atomic_dir(folder) as tmp:
        if tmp is not None:
            n_train, n_eval = BUILTIN_SIZES[kind]
            make(kind, tmp, n_train=n_train, n_eval=n_eval, noise=BUILTIN_SFT_NOISE if kind == "sft" else None)
    return folder / f"{split}.jsonl"
