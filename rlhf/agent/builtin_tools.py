"""The built-in tools: ``python`` (code run in the sandbox) and ``lookup`` (the keymap task's hidden
table, ``rlhf.data.builtin``: the key→value task whose mapping is behind a tool, not in the prompt)."""

from __future__ import annotations

from typing import Any, Optional, Union

from rlhf.agent.tools import Tool, ToolFailed, tool_from_function
from rlhf.spec.errors import UserError

BUILTINS = ("lookup", "python")


def lookup(key: str) -> str:
    """Look up the value stored under a key in the table.

    Args:
        key: the key, e.g. k3
    """
    from rlhf.data.builtin import table

    t = table()
    if key not in t:
        raise KeyError(f"no key {key!r}; keys are {', '.join(sorted(t))}")
    return t[key]


def python_tool(pool: Any = None, timeout_s: Optional[float] = None) -> Tool:
    """``python(code)``: runs the code in a fresh sandbox (``rlhf.agent.sandbox``) and answers with its
    standard output; a failure answers with the end of its standard error."""
    from rlhf.agent.sandbox import default_pool

    async def python(code: str) -> str:
        p = pool or default_pool()
        res = await p.run_async(code)
        if res.ok:
            return res.stdout if res.stdout else "(no output)"
        tail = res.stderr.strip().splitlines()[-6:]
        why = res.error_text()
        detail = ("\n".join(tail) + "\n" if tail else "") + why
        if res.killed == "wall":
            raise ToolFailed(detail, kind="timeout", sandbox_kill="wall")
        if res.killed is not None:
            raise ToolFailed(detail, kind="sandbox", sandbox_kill=res.killed)
        raise ToolFailed(detail, kind="raised")

    wall = (pool.limits.wall_s if pool is not None else 10.0)
    # the sandbox enforces its own wall clock; the tool's timeout only backs it up
    return Tool(name="python", description="Run Python code (standard library only) and return what it prints.",
                parameters={"type": "object", "properties": {"code": {"type": "string", "description":
                            "the program; print what you need to see"}}, "required": ["code"],
                            "additionalProperties": False},
                fn=python, timeout_s=float(timeout_s) if timeout_s is not None else wall + 5.0)


def make(name: str, sandbox: Any = None, **overrides) -> Tool:
    if name == "python":
        return python_tool(sandbox, timeout_s=overrides.get("timeout_s"))
    if name == "lookup":
        return tool_from_function(lookup, **overrides)
    raise UserError(f"builtin:{name} is not a built-in tool. Choose one of: "
                    f"{', '.join('builtin:' + b for b in BUILTINS)}.")


def load_tools(entries: list[Union[str, dict]], sandbox: Any = None) -> list[Tool]:
    """Tools from config entries: ``"builtin:python"``, ``"module:function"``, or a dict with
    ``fn`` and optional ``name``, ``schema``, ``description``, ``timeout_s``. ``sandbox`` (a
    ``SandboxPool``) runs ``builtin:python``; the process's default pool when None."""
    out = []
    for e in entries:
        d = {"fn": e} if isinstance(e, str) else dict(e)
        ref = d.pop("fn", None)
        if not isinstance(ref, str):
            raise UserError(f"tool entry {e!r}: give fn=module:function or fn=builtin:<name>.")
        if ref.startswith("builtin:"):
            out.append(make(ref.partition(":")[2], sandbox=sandbox, **d))
        else:
            out.append(tool_from_function(ref, **d))
    return out
