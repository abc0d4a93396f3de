"""The built-in task ``keymap``: a synthetic task that a tiny model learns in a minute of RL.

A fixed, seeded table maps each of ``N_KEYS`` key words to a value word. The prompt lists
``ANSWER_LEN`` keys (1 by default); the best response maps each of them through the table, in
order, and stops:

    prompt:   "key k3"              answer: "v4"        best response: "v4" <eos>
    reward:   0.75 × fraction of right values + 0.25 if it stops right after the answer
              (in [0, 1]; optimum 1.0)

A response that ignores the prompt does poorly: a constant one-word answer scores 0.75/8 + 0.25 = 0.34
on average, a random policy about 0.05. The data files are jsonl rows ``{"prompt", "answer"}``
generated on first use under ``cache_dir()/data/keymap-v<VERSION>/`` and read through the same
path users' files take; the reward ``rlhf.rewards.builtin:keymap_reward`` reads the ``answer``
column that the data path passes along as metadata.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf.paths import cache_dir
from rlhf.rewards.builtin import STOP_CREDIT, score  # noqa: F401 - the task's reward, named here too

VERSION = 8
N_KEYS = 8
N_VALUES = 8
ANSWER_LEN = 1
SEED = 1234
SPLITS = {"train": 1024, "eval": 64}

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
KEYS = [f"k{i}" for i in range(N_KEYS)]
VALUES = [f"v{i}" for i in range(N_VALUES)]
WORDS = ["key", "="] + KEYS + VALUES
VOCAB = SPECIAL + WORDS  # the tokenizer's vocabulary, in id order


def table() -> dict[str, str]:
    """key -> its value: a fixed random one-to-one map (SEED), so a constant answer scores 1/N_VALUES."""
    rng = random.Random(SEED)
    perm = list(VALUES)
    rng.shuffle(perm)
    return dict(zip(KEYS, perm))


def answer_for(keys: list[str]) -> str:
    t = table()
    return " ".join(t[k] for k in keys)


def prompt_for(keys: list[str]) -> str:
    return "key " + " ".join(keys)


def rows(split: str) -> list[dict]:
    rng = random.Random(f"{SEED}-{split}")
    out = []
    for _ in range(SPLITS[split]):
        keys = [rng.choice(KEYS) for _ in range(ANSWER_LEN)]
        out.append({"prompt": prompt_for(keys), "answer": answer_for(keys)})
    return out


def data_file(name: str) -> Path:
    """``keymap/train`` or ``keymap/eval`` -> the jsonl path, generating it atomically if missing."""
    task, _, split = name.partition("/")
    if task != "keymap" or split not in SPLITS:
        from rlhf.spec.errors import UserError

        raise UserError(
            f"builtin:{name} is not a built-in data set. Use builtin:keymap/train or builtin:keymap/eval."
        )
    folder = cache_dir() / "data" / f"keymap-v{VERSION}"
    path = folder / f"{split}.jsonl"
    if not path.exists():
        from rlhf.storage import atomic_dir

        with atomic_dir(folder) as tmp:
            if tmp is not None:
                for s in SPLITS:
                    with open(tmp / f"{s}.jsonl", "w") as f:
                        for row in rows(s):
                            f.write(json.dumps(row) + "\n")
    return path
