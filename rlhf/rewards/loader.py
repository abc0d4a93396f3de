"""Load reward functions by name and score batches with them (see the package docstring)."""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import os
import sys
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
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    threading.Thread(target=target, name="reward", daemon=True).start()
    return fut


@dataclass
class RewardFunction:
    name: str
    ref: str
    fn: Callable
    weight: float
    timeout_s: Optional[float] = -1.0  # -1: reward.timeout_s; None: no limit (the callee bounds itself)


class Rewards:
    """The configured reward functions; ``score`` returns the weighted total and each part."""

    def __init__(self, reward_spec: RewardSpec):
        self.timeout_s = reward_spec.timeout_s
        self.functions: list[RewardFunction] = []
        seen: dict[str, int] = {}
        for f in reward_spec.functions:
            base = f.name or f.fn.rpartition(":")[2]
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}_{seen[base]}"
            self.functions.append(RewardFunction(name, f.fn, load_function(f.fn), float(f.weight)))
        remote = getattr(reward_spec, "remote", None)
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
        fut = _submit_daemon(rf.fn, list(prompts), list(responses), **kwargs)
        try:
            out = fut.result(timeout=self.timeout_s if rf.timeout_s == -1.0 else rf.timeout_s)
        except UserError:
            raise
        except concurrent.futures.TimeoutError:
            raise UserError(
                f"reward function {rf.ref} took more than reward.timeout_s={self.timeout_s} s on {len(responses)} "
                "samples. Make it faster or raise reward.timeout_s."
            ) from None
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"reward function {rf.ref} raised {type(e).__name__}: {e}. Its signature must be "
                "fn(prompts: list[str], responses: list[str], **metadata) -> list[float].".replace("\n", " ")
            ) from None
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
