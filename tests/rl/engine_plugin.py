"""A third rollout engine from a plugin module (``rollout.plugins=[tests.rl.engine_plugin]``,
``rollout.engine=logged_hf``): the HF engine behind a wrapper that notes every call in
``<run dir>/engine_calls.jsonl``, so the test sees that the run sampled through it. Nothing in
rlhf/ names it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhf.rollout.engine import Sample, Sampling
from rlhf.rollout.hf_kind import HFKind
from rlhf.rollout.registry import register_engine


class LoggedEngine:
    """Forwards every ``RolloutEngine`` call to ``inner`` and appends one line per call to ``log``."""

    def __init__(self, inner: Any, log: Path):
        self.inner, self.log = inner, log

    def _note(self, method: str, **fields: Any) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "method": method, **fields}) + "\n")

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        self._note("generate", prompts=len(prompt_token_ids), n=sampling.n)
        return self.inner.generate(prompt_token_ids, sampling)

    def sample(self, prompt_ids: list[int], sampling: Sampling) -> Sample:
        self._note("sample")
        return self.inner.sample(prompt_ids, sampling)

    def load_weights(self, named_tensors: dict) -> None:
        self._note("load_weights", tensors=len(named_tensors))
        self.inner.load_weights(named_tensors)

    def sleep(self, level: int = 1) -> dict[str, float]:
        return self.inner.sleep(level)

    def wake_up(self, tags: Any = None) -> float:
        return self.inner.wake_up(tags)

    def close(self) -> None:
        self.inner.close()


@register_engine
class LoggedHF(HFKind):
    name = "logged_hf"
    auto_on = ()  # chosen by name only

    def create(self, spec, tokenizer, device, settings):
        return LoggedEngine(super().create(spec, tokenizer, device, settings), Path(spec.run_dir) / "engine_calls.jsonl")
