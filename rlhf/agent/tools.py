"""Tools a model may call: declared as ``module:function`` (or ``path/file.py:function``) or built in
(``builtin:python``, ``builtin:lookup``), run off the event loop, every failure an answer.

A tool is a Python function. Its JSON schema comes from its signature and docstring, or is given:

    def lookup(key: str) -> str:
        \"\"\"Look up the value stored under a key.

        Args:
            key: the key, e.g. k3
        \"\"\"

becomes ``{"name": "lookup", "description": "Look up the value stored under a key.", "parameters":
{"type": "object", "properties": {"key": {"type": "string", "description": "the key, e.g. k3"}},
"required": ["key"], "additionalProperties": false}}``. Annotations map as str → string, int →
integer, float → number, bool → boolean, list[T] → array, dict → object, Literal[...] → enum,
Optional[T] → T; a parameter with a default is optional. The function may be ``async``; its
result is sent to the model as text (``str``, else JSON).

``ToolSet.call`` never raises for the model's mistakes or the tool's failures: each becomes the
tool message the model reads next, with its kind counted (``ERROR_KINDS``):

    malformed      the call could not be read (bad JSON, missing name, unclosed tag)
    unknown_tool   no tool of that name
    bad_arguments  the arguments do not match the schema
    raised         the tool raised (for ``python``: the code exited with an error)
    timeout        the tool ran past its time (a plain function's thread is abandoned, not killed:
                   untrusted code belongs in the sandbox)
    sandbox        the sandbox killed the code (CPU, memory, output or process limit)
    limit          the trajectory's tool-call budget was spent
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import re
import time
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from rlhf.agent.parsers import ParseError, ToolCall
from rlhf.spec.errors import UserError

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "sandbox", "limit")
DEFAULT_TIMEOUT_S = 10.0
MAX_RESULT_CHARS = 2000


class ToolFailed(Exception):
    """Raised by a tool to answer with an error of a given kind (built-ins use it for sandbox kills)."""

    def __init__(self, message: str, kind: str = "raised", sandbox_kill: Optional[str] = None):
        super().__init__(message)
        self.kind = kind
        self.sandbox_kill = sandbox_kill


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of type object
    fn: Callable[..., Any]
    timeout_s: float = DEFAULT_TIMEOUT_S

    def schema(self) -> dict:
        """The OpenAI-style function schema that chat templates render (``tools=``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolOutcome:
    name: str
    content: str  # what the model reads as the tool's answer
    error: Optional[str] = None  # one of ERROR_KINDS, None on success
    latency_s: float = 0.0
    sandbox_kill: Optional[str] = None  # the sandbox's kill cause (rlhf.agent.sandbox.KILL_CAUSES)


# ------------------------------------------------------------------------------- schema from code

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(ann: Any, where: str) -> tuple[dict, bool]:
    """(schema of ``ann``, whether None is allowed)."""
    origin = typing.get_origin(ann)
    if ann in _SIMPLE:
        return {"type": _SIMPLE[ann]}, False
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], where)[0], True
        return {"anyOf": [_json_type(a, where)[0] for a in args]}, len(args) < len(typing.get_args(ann))
    if origin is list:
        (item,) = typing.get_args(ann) or (Any,)
        return ({"type": "array", "items": _json_type(item, where)[0]} if item is not Any else {"type": "array"}), False
    if origin is dict:
        return {"type": "object"}, False
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(ann))}, False
    if ann is Any:
        return {}, False
    raise UserError(f"tool {where}: annotation {ann!r} has no JSON schema type. Use str, int, float, bool, "
                    "list[...], dict, Literal[...] or Optional[...], or give the tool an explicit schema.")


def _doc_params(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style (``Args:``) or Sphinx-style
    (``:param x:``) docstring; the description is the text before the parameter section."""
    doc = inspect.cleandoc(doc or "")
    params: dict[str, str] = {}
    for m in re.finditer(r":param\s+(?:\w+\s+)?(\w+):\s*(.+)", doc):
        params[m.group(1)] = m.group(2).strip()
    lines = doc.splitlines()
    desc_lines: list[str] = []
    i = 0
    while i < len(lines) and not re.match(r"^(Args|Arguments|Parameters|Returns|Raises):\s*$", lines[i].strip()) \
            and not lines[i].lstrip().startswith(":"):
        desc_lines.append(lines[i])
        i += 1
    section = None
    for line in lines[i:]:
        head = re.match(r"^(Args|Arguments|Parameters|Returns|Raises):\s*$", line.strip())
        if head:
            section = head.group(1)
            continue
        m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if section in ("Args", "Arguments", "Parameters") and m:
            params[m.group(1)] = m.group(2).strip()
        elif section in ("Args", "Arguments", "Parameters") and line.strip() and params:
            last = list(params)[-1]
            params[last] = (params[last] + " " + line.strip()).strip()
    return " ".join(x.strip() for x in desc_lines if x.strip()), params


def schema_from_function(fn: Callable, name: str) -> tuple[str, dict]:
    """(description, parameters schema) of ``fn`` from its signature and docstring."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - an annotation that does not resolve
        raise UserError(f"tool {name}: its annotations do not resolve ({type(e).__name__}: {e}).") from None
    desc, docs = _doc_params(fn.__doc__ or "")
    props: dict[str, dict] = {}
    required: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.POSITIONAL_ONLY:
            raise UserError(f"tool {name}: parameter {p.name!r} is positional-only; tools are called with keywords.")
        if p.name not in hints:
            raise UserError(f"tool {name}: parameter {p.name!r} has no type annotation. Annotate it "
                            "(str, int, float, bool, list[...], dict) or give the tool an explicit schema.")
        schema, nullable = _json_type(hints[p.name], f"{name}({p.name})")
        if nullable:
            schema = ({**schema, "type": [schema["type"], "null"]} if isinstance(schema.get("type"), str)
                      else {"anyOf": [schema, {"type": "null"}]})
        if p.name in docs:
            schema = {**schema, "description": docs[p.name]}
        if p.default is p.empty:
            required.append(p.name)
        else:
            try:
                schema = {**schema, "default": json.loads(json.dumps(p.default))}
            except TypeError:
                pass
        props[p.name] = schema
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return desc or name, params


def tool_from_function(fn: Union[Callable, str], name: Optional[str] = None, schema: Optional[dict] = None,
                       description: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Tool:
    """A Tool from a function or its ``module:function`` name; ``schema`` (the parameters' JSON
    schema) replaces the one read from the signature."""
    if isinstance(fn, str):
        from rlhf.rewards.loader import load_function

        ref = fn
        try:
            fn = load_function(fn)
        except UserError as e:
            raise UserError(str(e).replace("reward function", "tool", 1)) from None
        name = name or ref.rpartition(":")[2]
    name = name or getattr(fn, "__name__", "tool")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
        raise UserError(f"tool name {name!r}: use letters, digits, _ . - (at most 64, not starting with a digit).")
    if schema is None:
        desc, params = schema_from_function(fn, name)
    else:
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise UserError(f"tool {name}: its schema is not a valid JSON schema ({e.message}).") from None
        if schema.get("type") != "object":
            raise UserError(f"tool {name}: its schema must have \"type\": \"object\" (the call's arguments).")
        desc, params = _doc_params(fn.__doc__ or "")[0] or name, dict(schema)
    return Tool(name=name, description=description or desc, parameters=params, fn=fn, timeout_s=float(timeout_s))


# ------------------------------------------------------------------------------------- running

def _result_text(value: Any, max_chars: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n... [{len(text) - max_chars} more characters cut]"
    return text


class ToolSet:
    """The tools of a run; ``call`` runs one call (plain functions in a thread pool, so the event
    loop keeps driving other trajectories) and returns its outcome."""

    def __init__(self, tools: list[Tool], threads: int = 8, max_result_chars: int = MAX_RESULT_CHARS):
        names = [t.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"tool names must be unique: {', '.join(dup)} declared more than once. Give one a name.")
        self.tools = {t.name: t for t in tools}
        self.max_result_chars = max_result_chars
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tool")
        self._validators: dict[str, Any] = {}

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def subset(self, names: list[str]) -> "ToolSet":
        """The tools named (in that order), sharing this set's threads: what one prompt offers."""
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise UserError(f"tool(s) {', '.join(map(repr, unknown))} named by a data row are not among the "
                            f"configured tools ({', '.join(self.tools) or 'none'}): add them to agent.tools.")
        sub = object.__new__(ToolSet)
        sub.tools = {n: self.tools[n] for n in dict.fromkeys(names)}
        sub.max_result_chars = self.max_result_chars
        sub._threads = self._threads
        sub._validators = self._validators
        return sub

    def malformed(self, err: ParseError) -> ToolOutcome:
        return ToolOutcome(name="", error="malformed",
                           content=f"Error: could not read the tool call ({err.reason}). Write "
                                   '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.')

    def over_budget(self, call: ToolCall, budget: int) -> ToolOutcome:
        return ToolOutcome(name=call.name, error="limit",
                           content=f"Error: tool call limit reached ({budget} per conversation); not run.")

    def _validate(self, tool: Tool, args: dict) -> Optional[str]:
        import jsonschema

        v = self._validators.get(tool.name)
        if v is None:
            v = self._validators[tool.name] = jsonschema.Draft202012Validator(tool.parameters)
        errors = sorted(v.iter_errors(args), key=lambda e: list(e.path))
        if not errors:
            return None
        e = errors[0]
        where = ".".join(str(p) for p in e.path)
        return f"{where}: {e.message}" if where else e.message

    async def call(self, call: ToolCall, timeout_s: Optional[float] = None) -> ToolOutcome:
        t0 = time.monotonic()
        out = await self._call(call, timeout_s)
        out.latency_s = time.monotonic() - t0
        return out

    async def _call(self, call: ToolCall, timeout_s: Optional[float]) -> ToolOutcome:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(call.name, f"Error: unknown tool {call.name!r}. Available: "
                                          f"{', '.join(sorted(self.tools)) or 'none'}.", error="unknown_tool")
        problem = self._validate(tool, call.arguments)
        if problem is not None:
            return ToolOutcome(call.name, f"Error: bad arguments for {call.name}: {problem}", error="bad_arguments")
        limit = tool.timeout_s if timeout_s is None else min(tool.timeout_s, timeout_s)
        try:
            if inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**call.arguments), timeout=limit)
            else:
                loop = asyncio.get_running_loop()
                fut = loop.run_in_executor(self._threads, functools.partial(tool.fn, **call.arguments))
                value = await asyncio.wait_for(fut, timeout=limit)
        except asyncio.TimeoutError:
            return ToolOutcome(call.name, f"Error: {call.name} timed out after {limit:g} s.", error="timeout")
        except ToolFailed as e:
            return ToolOutcome(call.name, _result_text(f"Error: {e}", self.max_result_chars), error=e.kind,
                               sandbox_kill=e.sandbox_kill)
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            return ToolOutcome(call.name, _result_text(f"Error: {call.name} raised {type(e).__name__}: {e}",
                                                       self.max_result_chars), error="raised")
        return ToolOutcome(call.name, _result_text(value, self.max_result_chars))

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

