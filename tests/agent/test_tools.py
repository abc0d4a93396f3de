"""Tool-call parsing, tool schemas from code, and every way a call can fail becoming an answer."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal, Optional

import pytest

from rlhf.agent.parsers import ToolCall, get_parser, parser_names, register_parser
from rlhf.agent.sandbox import SandboxLimits, SandboxPool
from rlhf.agent.builtin_tools import load_tools
from rlhf.agent.tools import ERROR_KINDS, ToolFailed, ToolSet, schema_from_function, tool_from_function
from rlhf.spec.errors import UserError
from tests.helpers import assert_clear

# --------------------------------------------------------------------------------------- parsers


def test_hermes_reads_calls_between_text():
    text = ('Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k3"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    p = get_parser("hermes").parse(text)
    assert p.calls == [ToolCall("lookup", {"key": "k3"}), ToolCall("python", {"code": "print(1)"})]
    assert p.content == "Let me check."
    assert p.errors == []


def test_hermes_plain_text_has_no_calls():
    p = get_parser("hermes").parse("The answer is v4.")
    assert p.calls == [] and p.errors == [] and p.content == "The answer is v4."


@pytest.mark.parametrize("body, reason", [
    ('{"name": "lookup", "arguments": {"key": "k3"}', "not valid JSON"),
    ('["lookup"]', "expected a JSON object, got list"),
    ('{"arguments": {}}', 'missing "name"'),
    ('{"name": "lookup", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "lookup", "arguments": "k3"}', '"arguments" is a string that is not a JSON object'),
])
def test_hermes_malformed_calls_are_errors_not_exceptions(body, reason):
    p = get_parser("hermes").parse(f"x <tool_call>{body}</tool_call> y")
    assert p.calls == []
    assert len(p.errors) == 1 and reason in p.errors[0].reason, p.errors
    assert p.content == "x  y"


def test_hermes_arguments_given_as_a_json_string_are_read():
    p = get_parser("hermes").parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert p.calls == [ToolCall("f", {"a": 1})]


def test_hermes_unclosed_and_stray_tags():
    p = get_parser("hermes").parse('<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", '
                                   '"arguments": {}}</tool_call> and </tool_call>')
    assert p.calls == [ToolCall("b", {})]
    assert [e.reason for e in p.errors] == ["<tool_call> without </tool_call>", "</tool_call> without <tool_call>"]
    p = get_parser("hermes").parse('<tool_call>{"name": "a"')  # cut by the token limit
    assert p.calls == [] and len(p.errors) == 1


def test_parser_registry():
    assert "hermes" in parser_names()
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes")(lambda: None)
    with pytest.raises(UserError) as e:
        get_parser("mistral9")
    assert_clear(str(e.value), "mistral9", "hermes")

# ---------------------------------------------------------------------------------------- schemas


def search(query: str, limit: int = 5, lang: Optional[str] = None, tags: list[str] = (),
           mode: Literal["fast", "exact"] = "fast", weight: float = 1.0, strict: bool = False) -> list:
    """Search the notes for a query.

    Longer explanation that is part of the description.

    Args:
        query: what to look for
        limit (int): how many results,
            at most
        lang: a language code
    Returns:
        the hits
    """


def test_schema_from_signature_and_google_docstring():
    desc, params = schema_from_function(search, "search")
    assert desc == "Search the notes for a query. Longer explanation that is part of the description."
    assert params == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "how many results, at most", "default": 5},
            "lang": {"type": ["string", "null"], "description": "a language code", "default": None},
            "tags": {"type": "array", "items": {"type": "string"}, "default": []},
            "mode": {"enum": ["fast", "exact"], "default": "fast"},
            "weight": {"type": "number", "default": 1.0},
            "strict": {"type": "boolean", "default": False},
        },
        "required": ["query"],
        "additionalProperties": False,
    }


def sphinx(a: int, b: dict) -> int:
    """Add things.

    :param a: first
    :param b: second
    """
    return a


def test_schema_from_sphinx_docstring_and_errors():
    desc, params = schema_from_function(sphinx, "sphinx")
    assert desc == "Add things."
    assert params["properties"] == {"a": {"type": "integer", "description": "first"},
                                    "b": {"type": "object", "description": "second"}}

    def untyped(x):
        return x

    with pytest.raises(UserError) as e:
        schema_from_function(untyped, "untyped")
    assert_clear(str(e.value), "untyped", "'x'", "explicit schema")

    def odd(x: complex):
        return x

    with pytest.raises(UserError) as e:
        schema_from_function(odd, "odd")
    assert_clear(str(e.value), "odd(x)", "complex")


def test_explicit_schema_and_module_function_names():
    t = tool_from_function("rlhf.agent.builtin_tools:lookup")
    assert t.name == "lookup" and t.parameters["required"] == ["key"]
    assert t.description == "Look up the value stored under a key in the table."
    schema = {"type": "object", "properties": {"key": {"type": "string", "enum": ["k0", "k1"]}}, "required": ["key"]}
    t2 = tool_from_function("rlhf.agent.builtin_tools:lookup", name="get", schema=schema)
    assert t2.name == "get" and t2.parameters == schema
    assert t2.schema() == {"type": "function", "function": {"name": "get", "description": t.description,
                                                            "parameters": schema}}
    with pytest.raises(UserError) as e:
        tool_from_function("rlhf.agent.builtin_tools:nothing_here")
    assert_clear(str(e.value), "tool", "nothing_here")
    with pytest.raises(UserError) as e:
        tool_from_function(sphinx, schema={"type": "array"})
    assert_clear(str(e.value), "sphinx", '"type": "object"')
    with pytest.raises(UserError) as e:
        load_tools(["builtin:shell"])
    assert_clear(str(e.value), "builtin:shell", "builtin:python")

# -------------------------------------------------------------------------------------- outcomes


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def async_echo(text: str) -> dict:
    """Echo."""
    await asyncio.sleep(0)
    return {"echo": text}


def boom(x: int) -> str:
    """Raise."""
    raise RuntimeError(f"bad {x}")


RELEASE = threading.Event()


def stuck(x: int) -> str:
    """Never returns in time."""
    RELEASE.wait(30)
    return "late"


def refuses(x: int) -> str:
    """Fails with a chosen kind."""
    raise ToolFailed("the sandbox said no", kind="sandbox", sandbox_kill="memory")


def huge() -> str:
    """Too much text."""
    return "y" * 10_000


@pytest.fixture(scope="module")
def toolset():
    ts = ToolSet([tool_from_function(f) for f in (add, async_echo, boom, refuses, huge)]
                 + [tool_from_function(stuck, timeout_s=0.3)], max_result_chars=100)
    yield ts
    RELEASE.set()
    ts.close()


def run(coro):
    return asyncio.run(coro)


def test_successful_calls(toolset):
    out = run(toolset.call(ToolCall("add", {"a": 2, "b": 3})))
    assert out.content == "5" and out.error is None and out.latency_s >= 0
    out = run(toolset.call(ToolCall("async_echo", {"text": "hi"})))
    assert out.content == '{"echo": "hi"}' and out.error is None


@pytest.mark.parametrize("call, kind, text", [
    (ToolCall("nope", {}), "unknown_tool", "unknown tool 'nope'. Available: add, async_echo, boom, huge, refuses, stuck."),
    (ToolCall("add", {"a": 1}), "bad_arguments", "'b' is a required property"),
    (ToolCall("add", {"a": 1, "b": "2"}), "bad_arguments", "b: '2' is not of type 'integer'"),
    (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "bad_arguments", "Additional properties are not allowed"),
    (ToolCall("boom", {"x": 7}), "raised", "boom raised RuntimeError: bad 7"),
    (ToolCall("stuck", {"x": 1}), "timeout", "stuck timed out after 0.3 s"),
    (ToolCall("refuses", {"x": 1}), "sandbox", "the sandbox said no"),
])
def test_every_failure_is_an_answer_with_its_kind(toolset, call, kind, text):
    out = run(toolset.call(call))
    assert out.error == kind and kind in ERROR_KINDS
    assert out.content.startswith("Error: ") and text in out.content, out.content


def test_long_results_are_cut(toolset):
    out = run(toolset.call(ToolCall("huge", {})))
    assert out.content.startswith("y" * 100) and "9900 more characters cut" in out.content


def test_malformed_and_over_budget_answers(toolset):
    from rlhf.agent.parsers import ParseError

    m = toolset.malformed(ParseError("<tool_call>{", "not valid JSON"))
    assert m.error == "malformed" and "not valid JSON" in m.content
    b = toolset.over_budget(ToolCall("add", {}), 3)
    assert b.error == "limit" and "3 per conversation" in b.content


def test_duplicate_tool_names_are_refused():
    with pytest.raises(UserError) as e:
        ToolSet([tool_from_function(add), tool_from_function(add)])
    assert_clear(str(e.value), "add", "unique")

# ----------------------------------------------------------------------------- the python tool


@pytest.fixture(scope="module")
def python_tools():
    pool = SandboxPool(SandboxLimits(cpu_s=1, wall_s=20.0, memory_mb=512, output_bytes=4096), workers=2)
    ts = ToolSet(load_tools(["builtin:python", {"fn": "builtin:lookup", "timeout_s": 2}], sandbox=pool))
    yield ts
    ts.close()
    pool.close()


def test_python_tool_answers_with_output_and_errors(python_tools):
    out = run(python_tools.call(ToolCall("python", {"code": "print(sum(range(10)))"})))
    assert out.error is None and out.content == "45\n"
    out = run(python_tools.call(ToolCall("python", {"code": "1/0"})))
    assert out.error == "raised" and "ZeroDivisionError" in out.content and out.sandbox_kill is None
    out = run(python_tools.call(ToolCall("python", {"code": "while True: pass"})))
    assert out.error == "sandbox" and out.sandbox_kill == "cpu" and "CPU time limit" in out.content
    out = run(python_tools.call(ToolCall("python", {"code": "print('z' * 100000)"})))
    assert out.error == "sandbox" and out.sandbox_kill == "output"


def test_lookup_tool(python_tools):
    from rlhf.data.builtin import table

    out = run(python_tools.call(ToolCall("lookup", {"key": "k3"})))
    assert out.error is None and out.content == table()["k3"]
    out = run(python_tools.call(ToolCall("lookup", {"key": "k99"})))
    assert out.error == "raised" and "no key 'k99'" in out.content


def test_calls_in_flight_together_overlap(python_tools):
    """Two sandboxed calls run at once (the pool has two slots): together they take less than the
    sum of their times alone would if they ran one after another (checked on the calls' own
    start/stop stamps, not a wall-clock threshold)."""
    code = "import time\nprint(time.time())\ntime.sleep(1.0)\nprint(time.time())"

    async def both():
        return await asyncio.gather(*[python_tools.call(ToolCall("python", {"code": code})) for _ in range(2)])

    a, b = run(both())
    (a0, a1), (b0, b1) = [tuple(map(float, o.content.split())) for o in (a, b)]
    assert a0 < b1 and b0 < a1  # the intervals intersect

