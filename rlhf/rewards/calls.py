"""One call of a user's reward function and what can go wrong with it, as one-line messages.

Shared by the two places a reward function runs: a thread of the driver (``reward.isolate=false``)
and the reward process (``rlhf.rewards.isolated``). Nothing here imports more than the standard
library and ``rlhf.spec.errors``, so the reward process starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Callable, Optional

from rlhf.spec.errors import UserError

SIGNATURE = "fn(prompts: list[str], responses: list[str], **metadata) -> list[float]"


class RewardError(UserError):
    """A reward function failed (raised, returned the wrong values, took too long, ended or
    crashed its process): the run stops with this one line; the steps done are checkpointed."""


def load_function(ref: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function`` -> the callable (UserError otherwise)."""
    target, _, name = ref.rpartition(":")
    if not target or not name:
        raise UserError(f"reward function {ref!r}: write module:function or path/to/file.py:function.")
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise UserError(f"reward function {ref!r}: file {target!r} does not exist (relative paths start at {os.getcwd()}).")
        mod_name = f"rlhf_user_reward_{abs(hash(path))}"
        try:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001
            raise UserError(f"reward function {ref!r}: importing {target} failed: {type(e).__name__}: {e}".split("\n")[0]) from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"reward function {ref!r}: cannot import module {target!r} ({type(e).__name__}: {e}). "
                "Check the name, or give a file path: path/to/file.py:function.".replace("\n", " ")
            ) from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise UserError(f"reward function {ref!r}: {target} has no function {name!r}.")
    return fn


def accepted(fn: Callable) -> Optional[tuple[str, ...]]:
    """The metadata names ``fn`` takes: None when it takes ``**metadata`` (every column), else its
    parameter names (the other columns are left out of the call)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return tuple(params)


def call_user(fn: Callable, args: tuple, kwargs: dict):
    return fn(*args, **kwargs)  # the frame whose callee is the user's code (``raised_inside``)


def raised_inside(e: BaseException) -> Optional[str]:
    """Where inside the user's function ``e`` was raised (``file:line`` of the innermost frame), or
    None when the call itself failed (a TypeError: a signature that does not take these arguments)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for i, t in enumerate(frames):
        if t.tb_frame.f_code is call_user.__code__:
            frames = frames[i + 1:]
            break
    if not frames:
        return None
    return f"{frames[-1].tb_frame.f_code.co_filename}:{frames[-1].tb_lineno}"


def raised_message(ref: str, e: BaseException, memory_gb: Optional[float] = None) -> str:
    """The line for an exception out of a call of ``ref`` (``memory_gb``: the reward process's cap)."""
    where = raised_inside(e)
    at = f" (at {where})" if where else ""
    if isinstance(e, SystemExit):
        return (f"reward function {ref} called sys.exit({e.code!r}){at}: a reward function returns its scores; "
                "it must not end its process.")
    if isinstance(e, MemoryError) and memory_gb:
        return (f"reward function {ref} ran out of memory: it asked for more than the reward process's cap "
                f"reward.memory_gb={memory_gb:g} (MemoryError{' at ' + where if where else ''}). Use less memory or raise reward.memory_gb.")
    text = " ".join(f"{type(e).__name__}: {e}".split())
    if where is None and isinstance(e, TypeError):  # the call itself: a signature that does not fit
        return f"reward function {ref} cannot be called as {SIGNATURE} ({text})."
    return f"reward function {ref} raised {text}" + (f"{at}." if where else ".")


def to_floats(ref: str, out) -> list[float]:
    try:
        return [float(v) for v in out]
    except Exception:  # noqa: BLE001
        raise RewardError(f"reward function {ref} returned {type(out).__name__}, not a list of numbers "
                          "(one per response).") from None


def check_values(ref: str, values: list[float], n: int) -> list[float]:
    """``values`` when there is one finite number per response (RewardError otherwise)."""
    if len(values) != n:
        raise RewardError(f"reward function {ref} returned {len(values)} values for {n} responses: "
                          "return one number per response.")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward function {ref} returned a non-finite value ({values[bad[0]]}) for response "
                          f"{bad[0]}: return finite numbers.")
    return values
