"""Prompt data for RL: read jsonl/json/parquet files (or ``builtin:<task>/<split>``), then serve
rows step by step in a seeded order, and turn their prompts into token ids.

Each row is a dict; the prompt text is ``row[spec.data.prompt_key]`` (rendered through the
tokenizer's chat template as a user message when ``data.chat_template`` is true); every other
column travels with the samples to the reward functions as metadata.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec
from rlhf.spec.schema import DataSpec

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def read_rows(name: str, prompt_key: Optional[str] = None, columns: Optional[Sequence[str]] = None) -> list[dict]:
    """All rows of one data file (``rlhf.data.files.load_file``: jsonl/json/parquet/csv, saved data
    sets, builtin:<task>/<split>, hub:<data set>), columns renamed by ``columns`` (data.columns: old:new),
    each problem one UserError naming the file, the row and the fix."""
    from rlhf.data.files import load_file

    rows = load_file(name, columns).rows
    if prompt_key is not None and not any(prompt_key in r for r in rows):
        cols = sorted({k for r in rows[:100] for k in r})
        guess = prompt_like(rows[:100], cols)
        raise UserError(
            f"data file {name!r} has no column {prompt_key!r} (columns: {', '.join(map(str, cols))}). "
            f"Set data.prompt_key to the prompt column (data.prompt_key={guess}), or rename it: "
            f"data.columns=[{guess}:{prompt_key}]."
        )
    return rows


# Column names that usually hold the prompt, most likely first.
PROMPT_NAMES = ("question", "query", "instruction", "problem", "input", "prompt", "messages", "text", "content")


def prompt_like(rows: list[dict], cols: Sequence[Any]) -> str:
    """The column most likely to hold the prompt: a usual prompt name, else the one whose values
    are the longest text (an answer column is usually shorter than its question)."""
    names = {str(c).lower(): str(c) for c in cols}
    for n in PROMPT_NAMES:
        if n in names:
            return names[n]

    def length(c: Any) -> float:
        texts = [r.get(c) for r in rows if isinstance(r.get(c), (str, list))]
        return sum(len(str(t)) for t in texts) / max(1, len(rows))

    return str(max(cols, key=length)) if cols else "x"


class PromptSource:
    """Rows of the training files, mixed by ``data.weights``, shuffled per epoch with the run seed."""

    def __init__(self, data_spec: DataSpec, seed: int):
        self.spec = data_spec
        self.files = [read_rows(f, data_spec.prompt_key, data_spec.columns) for f in data_spec.train_files]
        self.weights = list(data_spec.weights) if data_spec.weights else [len(r) for r in self.files]
        self.rng = random.Random(seed)
        self.consumed = 0
        self._orders = [self._order(i) for i in range(len(self.files))]
        self._pos = [0] * len(self.files)

    def _order(self, i: int) -> list[int]:
        idx = list(range(len(self.files[i])))
        if self.spec.shuffle:
            self.rng.shuffle(idx)
        return idx

    def drop(self, keep) -> int:
        """Remove the rows for which ``keep(row)`` is false (e.g. prompts over the length limit);
        returns how many. A file left empty is a UserError."""
        dropped = 0
        for i, name in enumerate(self.spec.train_files):
            rows = [r for r in self.files[i] if keep(r)]
            dropped += len(self.files[i]) - len(rows)
            if not rows:
                raise UserError(f"data file {name!r}: every prompt is longer than rollout.max_prompt_tokens. "
                                "Raise rollout.max_prompt_tokens, or give shorter prompts.")
            if len(rows) != len(self.files[i]):
                self.files[i] = rows
                self._orders[i] = self._order(i)
                self._pos[i] = 0
        if not self.spec.weights:
            self.weights = [len(r) for r in self.files]
        return dropped

    def next(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            i = 0 if len(self.files) == 1 else self.rng.choices(range(len(self.files)), weights=self.weights)[0]
            if self._pos[i] >= len(self._orders[i]):
                self._orders[i], self._pos[i] = self._order(i), 0
            out.append(self.files[i][self._orders[i][self._pos[i]]])
            self._pos[i] += 1
        self.consumed += n
        return out

    def state_dict(self) -> dict:
        """Where the data stands: rows served, position in each file's current epoch order, those
        orders, and the mixing/shuffling RNG. ``load_state_dict`` of it serves the same rows next."""
        return {"consumed": self.consumed, "pos": list(self._pos), "rng": self.rng.getstate(),
                "orders": [list(o) for o in self._orders]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["pos"]) != len(self.files):
            raise UserError(f"the checkpoint's data position has {len(state['pos'])} train files, this run "
                            f"{len(self.files)}: resume with the same data.train_files.")
        self.consumed = int(state["consumed"])
        self._pos = [int(p) for p in state["pos"]]
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        if "orders" in state:
            self._orders = [list(o) for o in state["orders"]]


def render_prompt(row: dict, data_spec: DataSpec, tokenizer) -> str:
    text = row[data_spec.prompt_key]
    if isinstance(text, list):  # chat messages
        return tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
    if data_spec.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": str(text)}], tokenize=False,
                                             add_generation_prompt=True)
    return str(text)


def tokenize_prompts(spec: RunSpec, tokenizer, rows: list[dict]) -> list[list[int]]:
    """Each row's prompt rendered (chat template or plain) and tokenised; an over-long prompt keeps
    its last ``rollout.max_prompt_tokens`` tokens."""
    out = []
    for row in rows:
        text = render_prompt(row, spec.data, tokenizer)
        templated = spec.data.chat_template or isinstance(row[spec.data.prompt_key], list)
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        out.append(ids[-spec.rollout.max_prompt_tokens:])  # keep the end of an over-long prompt
    return out
