"""A multi-turn toy environment over the keymap vocabulary (``rlhf.data.builtin``).

Turn 1 answers the row's prompt (``key k3`` → ``v4``). The environment scores the answer with the
keymap score and replies with the next key, ``key k<j>`` (a fixed chain: j = (i + 3) mod N_KEYS),
which the model answers in turn, up to ``env.max_turns``. Turn reward: the keymap score of that
turn's answer (value right 0.75 + stop 0.25); the episode's reward is the mean over turns.
"""

from __future__ import annotations

from typing import Optional

from rlhf.data.builtin import KEYS, N_KEYS, score, table


class KeymapChain:
    def __init__(self, max_turns: int = 1_000):
        self.max_turns = max_turns
        self.table = table()

    def reset(self, row: dict) -> None:
        self.key = str(row["prompt"]).split()[-1]
        self.turn = 0

    def step(self, response: str) -> tuple[Optional[str], float, bool]:
        reward = score(response, self.table[self.key])
        self.turn += 1
        self.key = KEYS[(KEYS.index(self.key) + 3) % N_KEYS]
        done = self.turn >= self.max_turns
        return (None if done else f"key {self.key}"), reward, done
