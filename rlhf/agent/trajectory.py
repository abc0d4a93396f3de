"""A chat trajectory's token sequence, built incrementally so the sampled tokens are never re-read.

The guarantee (docs/agent.md): a trajectory's ``token_ids`` are

    prompt ids  +  sampled ids of turn 1  +  delta ids 1  +  sampled ids of turn 2  +  ...

where the prompt ids are the chat template's rendering of the first messages (with the
generation prompt), each turn's sampled ids are exactly what the engine returned (never decoded
and encoded again), and each delta is the rendering of what follows an assistant turn up to the
next generation prompt (the end of the assistant's message that it did not sample itself, the tool
answers, the next ``<|im_start|>assistant``), tokenised alone. The engine is asked to continue
exactly ``token_ids`` at every turn, so the ids the trainer scores are the ids the policy was
conditioned on and sampled. ``loss_mask`` is 1 on sampled ids and 0 on everything else.

The delta's text comes from the template itself: ``ChatRenderer`` renders a probe conversation
ending in an assistant message, then the same with the new messages appended, and takes the
difference. A template that rewrites earlier turns when later ones are added (so that the longer
rendering does not start with the shorter) cannot be extended this way and is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf.spec.errors import UserError

_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_ASSISTANT = "\u2063probe-assistant\u2063"


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and extends a token sequence past an
    assistant turn (``delta_ids``)."""

    def __init__(self, tokenizer: Any, tools: Optional[list[dict]] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("the tokenizer has no chat template: agent rollouts render messages with it. "
                            "Use a chat model's tokenizer (or set tokenizer.chat_template).")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        self._base = base
        self._base_text = self.render(base, generation_prompt=False)
        at = self._base_text.find(_PROBE_ASSISTANT)
        if at < 0:
            raise UserError("the chat template does not render an assistant message's content as given; "
                            "agent rollouts need it to.")
        # what the template writes after an assistant's content (e.g. "<|im_end|>\n"): the engine
        # samples a prefix of it (its stop token), the delta supplies the rest
        self.assistant_suffix = self._base_text[at + len(_PROBE_ASSISTANT):]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first messages (system, user, ...) with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def split_sampled(self, sampled_text: str) -> tuple[str, str]:
        """(the assistant message's content, the part of the template's closing it did not
        sample). A turn that stopped on the template's end token has sampled a prefix of
        ``assistant_suffix``; one that stopped otherwise gets the whole closing."""
        suf = self.assistant_suffix
        for k in range(len(suf), 0, -1):
            if sampled_text.endswith(suf[:k]):
                return sampled_text[: len(sampled_text) - k], suf[k:]
        return sampled_text, suf

    def continuation_text(self, new_messages: list[dict]) -> str:
        """What the template writes after an assistant message for ``new_messages`` (tool or user
        turns), through the next generation prompt."""
        longer = self.render(self._base + list(new_messages), generation_prompt=True)
        if not longer.startswith(self._base_text):
            raise UserError("the chat template renders earlier turns differently once later turns are added, so "
                            "a trajectory cannot be extended token by token. Use a template whose rendering of a "
                            "conversation starts with its rendering of every shorter prefix.")
        return longer[len(self._base_text):]

    def delta_ids(self, sampled_text: str, new_messages: list[dict]) -> tuple[str, list[int]]:
        """(the assistant's content as text, the ids that follow its sampled ids)."""
        content, closing = self.split_sampled(sampled_text)
        return content, self.encode(closing + self.continuation_text(new_messages))


@dataclass
class Trajectory:
    """One conversation: the training sequence and what happened on the way."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # the engine's log-prob at sampled positions, 0.0 elsewhere
    prompt_len: int  # ids of the first rendering (the prompt the trainer does not score)
    messages: list[dict]
    row: dict = field(default_factory=dict)
    turns: int = 0  # assistant turns sampled
    outcomes: list = field(default_factory=list)  # ToolOutcome per tool message, in order
    finish: str = "stop"  # stop | length | turns | tool_calls | tokens | wall
    wall_s: float = 0.0

    TRUNCATIONS = ("length", "turns", "tool_calls", "tokens", "wall")

    @property
    def truncated(self) -> bool:
        """The conversation was cut by a limit, not ended by the model's answer."""
        return self.finish in self.TRUNCATIONS

    @property
    def tool_calls(self) -> int:
        return len(self.outcomes)

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def response_mask(self) -> list[int]:
        return self.loss_mask[self.prompt_len:]

    @property
    def response_logprobs(self) -> list[float]:
        return self.logprobs[self.prompt_len:]

    def append(self, ids: list[int], sampled: bool, logprobs: Optional[list[float]] = None) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if sampled else 0] * len(ids)
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(f"{len(ids)} sampled ids but {0 if logprobs is None else len(logprobs)} log-probs")
            self.logprobs += [float(x) for x in logprobs]
        else:
            self.logprobs += [0.0] * len(ids)

    def final_answer(self) -> str:
        """The content of the last assistant message."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return ""
