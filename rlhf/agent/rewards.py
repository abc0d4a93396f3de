"""The ``code`` reward: run a generated function's unit tests in the sandbox.

Declared like any reward function (``rlhf/rewards``):

    reward:
      functions:
        - fn: rlhf.agent.rewards:code_reward

It reads the data row's ``tests`` column: Python statements, one test per line (``assert
add(1, 2) == 3``). Each response's code (the last fenced ```python block, else the whole text)
runs in a fresh sandbox, then each test line in its own ``try``; the reward is the fraction of
tests that pass (0.0 when the code does not even run: a syntax error, a kill by any limit).

The pass count comes back on the sandbox's stdout behind a per-call random marker that the code
is not given; code that prints a fake count cannot know the marker. Code that searches the
interpreter's memory for it could (the harness and the code share one process): a policy that
learns to do so would show as a reward far above its tests' real pass rate when rescored.
Limits: ``SANDBOX_LIMITS`` (wall time 10 s, CPU 5 s, 512 MB) and the process's default pool.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Optional

from rlhf.agent.sandbox import SandboxLimits, SandboxPool, default_pool

SANDBOX_LIMITS = SandboxLimits(cpu_s=5, wall_s=10.0, memory_mb=512, output_bytes=64 * 1024)
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_code(response: str) -> str:
    """The last fenced code block of the response, else the response itself."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def harness(code: str, tests: list[str], marker: str) -> str:
    """The program the sandbox runs: the code, then each test alone, then the count behind ``marker``."""
    return (
        "def __rlhf_tests(__code, __tests, __marker):\n"
        "    __ns = {'__name__': '__main__'}\n"
        "    exec(compile(__code, 'solution.py', 'exec'), __ns)\n"
        "    __passed = 0\n"
        "    for __t in __tests:\n"
        "        try:\n"
        "            exec(compile(__t, 'test.py', 'exec'), __ns)\n"
        "            __passed += 1\n"
        "        except BaseException as __e:\n"
        "            if isinstance(__e, (MemoryError, KeyboardInterrupt)):\n"
        "                raise\n"
        "    import sys\n"
        "    sys.stdout.write('\\n' + __marker + ' %d\\n' % __passed)\n"
        "    sys.stdout.flush()\n"
        f"__rlhf_tests({code!r}, {tests!r}, {marker!r})\n"
    )


def parse_tests(tests) -> list[str]:
    """A ``tests`` cell: a list of statements, a JSON list, or one statement per line."""
    if isinstance(tests, (list, tuple)):
        return [str(t) for t in tests if str(t).strip()]
    text = str(tests)
    if text.lstrip().startswith("["):
        try:
            return [str(t) for t in json.loads(text) if str(t).strip()]
        except json.JSONDecodeError:
            pass
    return [line for line in text.splitlines() if line.strip()]


def pass_fractions(codes: list[str], tests: list, pool: Optional[SandboxPool] = None,
                   limits: Optional[SandboxLimits] = None) -> list[float]:
    """Per code, the fraction of its tests (a ``tests`` cell each) that pass in the sandbox.
    Identical (code, tests) pairs run once: a group's samples often write the same function, and
    its sandbox runs are most of a code step's time. (Code whose result depends on chance or the
    clock then gets one draw for all its copies.)"""
    pool = pool or default_pool()
    cases = [parse_tests(t) for t in tests]
    unique: dict[tuple[str, tuple[str, ...]], int] = {}
    index = [unique.setdefault((c, tuple(t)), len(unique)) for c, t in zip(codes, cases)]
    markers = [secrets.token_hex(16) for _ in unique]
    programs = [harness(c, list(t), mk) for (c, t), mk in zip(unique, markers)]
    results = pool.map(programs, limits=limits) if programs else []
    fractions = []
    for res, mk, (_, t) in zip(results, markers, unique):
        got = None
        if res.killed is None:
            for line in res.stdout.splitlines():
                if line.startswith(mk + " "):
                    got = int(line.split()[1])
        fractions.append(0.0 if got is None or not t else min(got, len(t)) / len(t))
    return [fractions[i] for i in index]


def code_reward(prompts: list[str], responses: list[str], tests: list, **metadata) -> list[float]:
    """The fraction of the row's ``tests`` that the response's code passes, run in the sandbox."""
    return pass_fractions([extract_code(r) for r in responses], list(tests), default_pool(), SANDBOX_LIMITS)
