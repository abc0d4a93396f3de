"""Synthetic agent tasks for the tiny chat model (``model=tiny-chat``), generated on first use as
``builtin:agent-<task>/<split>`` (jsonl under ``cache_dir()/data/``):

    agent-lookup/train|eval       RL rows: {"messages": [user "key k3"], "tools": ["lookup"], "answer": "v4"}
                                  the key→value table of the built-in task (rlhf.data.builtin) is not in
                                  the prompt: it is behind the ``lookup`` tool (builtin:lookup); the
                                  reward is the keymap score of the final answer
    agent-lookup-sft/train|eval   demonstrations: the user turn, a <tool_call> of lookup, the tool's
                                  answer, the final answer; with probability LOOKUP_NOISE the call
                                  asks for another key, and independently the final answer is
                                  another value (imperfect demonstrations, so RL after SFT has room
                                  to improve)
    agent-recall/train|eval       the lookup task's prompts with no tool offered (``"tools": []``): the
                                  model answers from what it learned of the table, in one turn (the
                                  same prompts, answers and reward as agent-lookup without the tool
                                  turn: the GPU recipe's step-time comparison, scripts/agent_gpu.sh)
    agent-recall-sft/train|eval   demonstrations: the user turn and the value, wrong with probability
                                  LOOKUP_NOISE (as agent-lookup-sft's final answer)
    agent-code/train|eval         RL rows: {"messages": [user "Write f(x) = x + 3 in Python."],
                                  "tests": [...]}: the reward runs the tests on the generated
                                  function in the sandbox (rlhf.agent.rewards:code_reward)
    agent-code-sft/train|eval     demonstrations: a fenced function; with probability NOISE its
                                  constant or operator is wrong

SFT rows carry the tools' JSON schemas in ``tools`` (what a chat template renders); RL rows name
the configured tools their prompt offers (``agent.tools_key``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf.paths import cache_dir

VERSION = 1
# a task's data version (its rows' seed, its folder's name) where it is not VERSION: agent-lookup-sft
# v2 has more noise (LOOKUP_NOISE); the other tasks' rows stay what they were
VERSIONS = {"agent-lookup-sft": 2}
TASKS = ("agent-lookup", "agent-lookup-sft", "agent-recall", "agent-recall-sft", "agent-code", "agent-code-sft")
SIZES = {"train": 512, "eval": 64}
NOISE = 0.35
# lookup demonstrations: the call asks for another key, and (independently) the final answer is another
# value, each with this probability (about half the demonstrations are right): after SFT the policy's
# samples are wrong often enough that RL has room to show (recipes/agent_lookup_tiny.yaml)
LOOKUP_NOISE = 0.3
OPS = {"+": lambda x, c: x + c, "-": lambda x, c: x - c, "*": lambda x, c: x * c}
TEST_INPUTS = (0, 1, 2, 5)


def lookup_call(key: str) -> str:
    """A Hermes tool call of ``lookup`` as the model writes it."""
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "\n</tool_call>"


def lookup_schema() -> dict:
    from rlhf.agent.builtin_tools import make

    return make("lookup").schema()


def _lookup_row(rng: random.Random, sft: bool) -> dict:
    from rlhf.data import builtin as task

    key = rng.choice(task.KEYS)
    table = task.table()
    user = {"role": "user", "content": task.prompt_for([key])}
    row = {"messages": [user], "answer": table[key]}
    if not sft:
        return {**row, "tools": ["lookup"]}
    asked = key if rng.random() >= LOOKUP_NOISE else rng.choice([k for k in task.KEYS if k != key])
    got = table[asked]
    final = got if rng.random() >= LOOKUP_NOISE else rng.choice([v for v in task.VALUES if v != got])
    msgs = [user, {"role": "assistant", "content": lookup_call(asked)},
            {"role": "tool", "name": "lookup", "content": got}, {"role": "assistant", "content": final}]
    return {**row, "messages": msgs, "tools": [lookup_schema()]}


def _recall_row(rng: random.Random, sft: bool) -> dict:
    from rlhf.data import builtin as task

    key = rng.choice(task.KEYS)
    value = task.table()[key]
    user = {"role": "user", "content": task.prompt_for([key])}
    row = {"messages": [user], "tools": [], "answer": value}
    if not sft:
        return row
    final = value if rng.random() >= LOOKUP_NOISE else rng.choice([v for v in task.VALUES if v != value])
    return {**row, "messages": [user, {"role": "assistant", "content": final}]}


def code_prompt(op: str, c: int) -> str:
    return f"Write f(x) = x {op} {c} in Python."


def code_solution(op: str, c: int) -> str:
    return f"```python\ndef f(x):\n    return x {op} {c}\n```"


def code_tests(op: str, c: int) -> list[str]:
    return [f"assert f({x}) == {OPS[op](x, c)}" for x in TEST_INPUTS]


def _code_row(rng: random.Random, sft: bool) -> dict:
    op, c = rng.choice(sorted(OPS)), rng.randrange(10)
    user = {"role": "user", "content": code_prompt(op, c)}
    row = {"messages": [user], "tests": code_tests(op, c)}
    if not sft:
        return row
    wop, wc = op, c
    if rng.random() < NOISE:  # a wrong constant or operator (that gives other values on the tests)
        if rng.random() < 0.5:
            wc = rng.choice([k for k in range(10) if k != c])
        else:
            wop = rng.choice([o for o in sorted(OPS) if o != op])
    return {**row, "messages": [user, {"role": "assistant", "content": code_solution(wop, wc)}]}


def rows(task: str, split: str) -> list[dict]:
    rng = random.Random(f"{task}-{split}-{VERSIONS.get(task, VERSION)}")
    make = {"agent-lookup": _lookup_row, "agent-recall": _recall_row}.get(task.removesuffix("-sft"), _code_row)
    return [make(rng, task.endswith("-sft")) for _ in range(SIZES[split])]


def data_file(name: str) -> Path:
    """``agent-<task>/<split>`` → its jsonl, generated atomically on first use."""
    from rlhf.spec.errors import UserError
    from rlhf.storage import atomic_dir

    task, _, split = name.partition("/")
    if task not in TASKS or split not in SIZES:
        raise UserError(f"builtin:{name} is not a built-in data set. Use builtin:<task>/<train|eval> with task one "
                        f"of {', '.join(TASKS)}.")
    folder = cache_dir() / "data" / f"{task}-v{VERSIONS.get(task, VERSION)}"
    with atomic_dir(folder) as tmp:
        if tmp is not None:
            for s in SIZES:
                with open(tmp / f"{s}.jsonl", "w") as f:
                    for row in rows(task, s):
                        f.write(json.dumps(row) + "\n")
    return folder / f"{split}.jsonl"
