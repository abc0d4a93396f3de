"""Load reward functions by name and score batches with them (see the package docstring)."""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from rlhf.spec.errors import UserError
from rlhf.spec.schema import RewardSpec


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


def _submit_daemon(fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
    """Run ``fn`` in a daemon thread: a reward function that hangs past reward.timeout_s is
    abandoned and cannot keep the process from exiting (a ThreadPoolExecutor's threads are joined
    at interpreter exit, so a hung call would block the run's exit forever)."""
    import threading

    fut: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(_call_user(fn, args, kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    threading.Thread(target=target, name="reward", daemon=True).start()
    return fut


class ThreadExecutor:
    """Where reward functions run: a daemon thread of the driver per call (``_submit_daemon``).

    The seam for isolation: ``Rewards(spec, executor=...)`` takes any object with
    ``submit(rf, prompts, responses, kwargs) -> Future`` and ``close()``. A process pool (the
    sandbox of the agent package) would call ``rf.ref`` (a ``module:function`` / ``file.py:function``
    it loads itself with ``load_function``) in a worker process and set the future's exception to a
    ``UserError`` naming ``rf.ref`` when that process dies (``os._exit``, a signal, its memory cap);
    ``Rewards._call`` turns the result, a timeout or an exception into the same one-line errors."""

    def submit(self, rf: "RewardFunction", prompts: list[str], responses: list[str],
               kwargs: dict) -> concurrent.futures.Future:
        return _submit_daemon(rf.fn, prompts, responses, **kwargs)

    def close(self) -> None:
        pass


SIGNATURE = "fn(prompts: list[str], responses: list[str], **metadata) -> list[float]"


def _call_user(fn: Callable, args: tuple, kwargs: dict):
    return fn(*args, **kwargs)  # the frame whose callee is the user's code (``_raised_inside``)


def _raised_inside(e: BaseException) -> Optional[str]:
    """Where inside the user's function ``e`` was raised (``file:line`` of the innermost frame), or
    None when the call itself failed (a TypeError: a signature that does not take these arguments)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for i, t in enumerate(frames):
        if t.tb_frame.f_code is _call_user.__code__:
            frames = frames[i + 1:]
            break
    if not frames:
        return None
    return f"{frames[-1].tb_frame.f_code.co_filename}:{frames[-1].tb_lineno}"


@dataclass
class RewardFunction:
    name: str
    ref: str
    fn: Callable
    weight: float
    timeout_s: Optional[float] = -1.0  # -1: reward.timeout_s; None: no limit (the callee bounds itself)


class Rewards:
    """The configured reward functions; ``score`` returns the weighted total and each part."""

    def __init__(self, reward_spec: RewardSpec, executor: Optional[ThreadExecutor] = None, remote: bool = True):
        self.timeout_s = reward_spec.timeout_s
        self.executor = executor or ThreadExecutor()
        self.functions: list[RewardFunction] = []
        seen: dict[str, int] = {}
        for f in reward_spec.functions:
            base = f.name or f.fn.rpartition(":")[2]
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}_{seen[base]}"
            self.functions.append(RewardFunction(name, f.fn, load_function(f.fn), float(f.weight)))
        remote = getattr(reward_spec, "remote", None) if remote else None
        if remote is not None:
            from rlhf.rewards.remote import RemoteReward

            client = RemoteReward(list(remote.urls), batch_size=remote.batch_size, concurrency=remote.concurrency,
                                  timeout_s=remote.timeout_s, retries=remote.retries)
            # no overall timeout: the client bounds each request (reward.remote.timeout_s, retries)
            self.functions.append(RewardFunction(remote.name, "reward.remote", client, float(remote.weight),
                                                 timeout_s=None))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def score(self, prompts: list[str], responses: list[str], metadata: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted sum per sample, {function name: its raw values})."""
        n = len(responses)
        total = [0.0] * n
        parts: dict[str, list[float]] = {}
        for rf in self.functions:
            values = self._call(rf, prompts, responses, metadata)
            parts[rf.name] = values
            for i, v in enumerate(values):
                total[i] += rf.weight * v
        return total, parts

    def _call(self, rf: RewardFunction, prompts, responses, metadata) -> list[float]:
        kwargs = dict(metadata)
        params = inspect.signature(rf.fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        limit = self.timeout_s if rf.timeout_s == -1.0 else rf.timeout_s
        too_slow = UserError(f"reward function {rf.ref} took more than reward.timeout_s={self.timeout_s} s on "
                             f"{len(responses)} samples. Make it faster or raise reward.timeout_s.")
        t0 = time.monotonic()
        fut = self.executor.submit(rf, list(prompts), list(responses), kwargs)
        try:
            out = fut.result(timeout=limit)
        except UserError:
            raise
        except concurrent.futures.TimeoutError:
            raise too_slow from None
        except BaseException as e:  # noqa: BLE001 - sys.exit inside the function too
            where = _raised_inside(e)
            text = " ".join(f"{type(e).__name__}: {e}".split())
            if where is None and isinstance(e, TypeError):  # the call itself: a signature that does not fit
                raise UserError(f"reward function {rf.ref} cannot be called as {SIGNATURE} ({text}).") from None
            raise UserError(f"reward function {rf.ref} raised {text}"
                            + (f" (at {where})." if where else ".")) from None
        # a call that returned after its limit is over it too (with a tiny limit, the function may
        # finish before the wait starts)
        if limit is not None and time.monotonic() - t0 > limit:
            raise too_slow
        try:
            values = [float(v) for v in out]
        except Exception:  # noqa: BLE001
            raise UserError(
                f"reward function {rf.ref} returned {type(out).__name__}, not a list of numbers "
                f"(one per response)."
            ) from None
        if len(values) != len(responses):
            raise UserError(
                f"reward function {rf.ref} returned {len(values)} values for {len(responses)} responses: "
                "return one number per response."
            )
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise UserError(
                f"reward function {rf.ref} returned a non-finite value ({values[bad[0]]}) for response {bad[0]}: "
                "return finite numbers."
            )
        return values

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.executor.close()
