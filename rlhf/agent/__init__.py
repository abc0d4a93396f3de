"""Agentic rollouts: multi-turn chat trajectories with tool calls, run concurrently.

    sandbox.py     model-written code in a fresh, limited, isolated process per call (a pool)
    tools.py       tools from ``module:function`` (schema from signature + docstring), their outcomes
    builtin_tools.py  ``builtin:python`` (sandboxed), ``builtin:lookup``; ``load_tools`` from config entries
    chat_tokenizer.py a tiny byte-level chat tokenizer with a ChatML/Hermes template
    parsers.py     tool-call formats in the model's output, by name (``hermes``: ``<tool_call>{json}``)
    trajectory.py  the token sequence of a chat: sampled ids kept exactly, loss mask on assistant tokens
    loop.py        the asyncio loop driving many trajectories against an async ``sample`` call
    metrics.py     per-step metrics from finished trajectories
    rewards.py     the ``code`` reward: a generated function's unit tests, run in the sandbox

docs/agent.md has the guide (writing a tool, the sandbox's guarantees, the token guarantee).
"""
