"""Tool calls in a model's turn, read in the format its chat template teaches, chosen by name.

A parser turns the decoded text of one assistant turn into the text outside the calls, the calls,
and the calls it could not read (each becomes an error answer to the model, never an exception).
Parsers are registered by name with ``@register_parser("name")``; a second registration of a name
is an error. ``hermes`` (Qwen2.5, Hermes, and most templates that follow them) reads

    <tool_call>
    {"name": "lookup", "arguments": {"key": "k3"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Protocol

from rlhf.spec.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParseError:
    snippet: str  # the unreadable call as the model wrote it (cut to 200 characters)
    reason: str


@dataclass
class ParsedTurn:
    content: str  # the turn's text outside the calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {}


def register_parser(name: str) -> Callable:
    def deco(factory: Callable[[], ToolCallParser]) -> Callable[[], ToolCallParser]:
        if name in _PARSERS:
            raise ValueError(f"tool-call parser {name!r} is already registered ({_PARSERS[name]!r}).")
        _PARSERS[name] = factory
        return factory

    return deco


def get_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise UserError(f"tool-call parser {name!r} not found. Choose one of: {', '.join(sorted(_PARSERS))}.")
    return _PARSERS[name]()


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def _call_from_json(body: str) -> ToolCall:
    """``{"name": str, "arguments": object}`` → ToolCall; ValueError saying what is wrong."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('missing "name" (a string)')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError('"arguments" is a string that is not a JSON object') from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args)


@register_parser("hermes")
class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks, any number per turn; an opening tag without its
    closing tag (the turn was cut, or the model forgot it) is one malformed call."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn(content="")
        pieces: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            end = text.find(self.close_tag, start + len(self.open_tag))
            nxt = text.find(self.open_tag, start + len(self.open_tag))
            if end < 0 or (0 <= nxt < end):
                stop = nxt if nxt >= 0 else len(text)
                out.errors.append(ParseError(text[start:stop][:200], f"{self.open_tag} without {self.close_tag}"))
                pos = stop
                continue
            body = text[start + len(self.open_tag):end]
            try:
                out.calls.append(_call_from_json(body.strip()))
            except ValueError as e:
                out.errors.append(ParseError(text[start:end + len(self.close_tag)][:200], str(e)))
            pos = end + len(self.close_tag)
        stray = self.close_tag in "".join(pieces)
        out.content = re.sub(r"\n{3,}", "\n\n", "".join(pieces)).strip()
        if stray:
            out.errors.append(ParseError(self.close_tag, f"{self.close_tag} without {self.open_tag}"))
        return out
