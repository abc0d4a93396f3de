"""A step's samples to scores: the configured reward functions (see the package docstring) on
the decoded texts, weighted, plus the reward model's score (``score_samples``).

Where a function runs is an executor: a process of its own (``rlhf.rewards.isolated``) or a thread
of the driver (``ThreadExecutor``). ``reward.isolate`` chooses: true, the process for every
function; false, the driver for every one; auto (the default), the driver for the project's own
functions (``rlhf.*`` modules: ``rlhf.rewards.builtin``, ``rlhf.rewards.math``, ...; pure Python
shipped and tested with the package) and the process for the user's.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from rlhf.rewards.calls import (RewardError, accepted, call_user, check_values, load_function, raised_message,
                                to_floats)
from rlhf.rewards.isolated import ProcessExecutor
from rlhf.spec.errors import UserError

if TYPE_CHECKING:
    import torch

    from rlhf.launch.group import ActorGroup
    from rlhf.rollout.engine import Sample
    from rlhf.spec.runspec import RunSpec
    from rlhf.spec.schema import RewardSpec

__all__ = ["RewardError", "RewardFunction", "Rewards", "ThreadExecutor", "load_function", "project_function",
           "score_samples"]


def project_function(ref: str) -> bool:
    """Whether ``ref`` names a function of this package by module (``rlhf.rewards.builtin:keymap_reward``),
    which ``reward.isolate=auto`` runs in the driver; a file path is the user's, wherever it is."""
    module = ref.rpartition(":")[0]
    return module == "rlhf" or module.startswith("rlhf.")


def _submit_daemon(fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
    """Run ``fn`` in a daemon thread: a reward function that hangs past reward.timeout_s is
    abandoned and cannot keep the process from exiting (a ThreadPoolExecutor's threads are joined
    at interpreter exit, so a hung call would block the run's exit forever)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(call_user(fn, args, kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    threading.Thread(target=target, name="reward", daemon=True).start()
    return fut


class ThreadExecutor:
    """Where reward functions run with ``reward.isolate=false``: imported into the driver, each call
    in a daemon thread of it (``_submit_daemon``); a debugger's breakpoint inside works, but a crash
    or ``os._exit`` takes the driver with it. Also what runs the remote reward's client, which is
    the project's own code.

    The executor interface (``rlhf.rewards.isolated.ProcessExecutor`` is the other one):
    ``load(ref)`` imports a function and returns the metadata names it takes (None: all);
    ``submit(rf, prompts, responses, kwargs) -> Future`` of its raw return value (an exception
    raised inside, or a ``RewardError`` already worded); ``close()``."""

    def __init__(self):
        self._fns: dict[str, Callable] = {}

    def load(self, ref: str) -> Optional[tuple[str, ...]]:
        self._fns[ref] = load_function(ref)
        return accepted(self._fns[ref])

    def submit(self, rf: "RewardFunction", prompts: list[str], responses: list[str],
               kwargs: dict) -> concurrent.futures.Future:
        return _submit_daemon(rf.fn if rf.fn is not None else self._fns[rf.ref], prompts, responses, **kwargs)

    def close(self) -> None:
        pass


@dataclass
class RewardFunction:
    name: str
    ref: str
    fn: Optional[Callable]  # what runs in the driver's threads (the project's own); None: the executor's, by ref
    weight: float
    timeout_s: Optional[float] = -1.0  # -1: reward.timeout_s; None: no limit (the callee bounds itself)
    takes: Optional[tuple[str, ...]] = None  # the metadata names it takes; None: all (**metadata)


class Rewards:
    """The configured reward functions; ``score`` returns the weighted total and each part.

    ``executor``: where the user's functions run; by default a process of their own
    (``ProcessExecutor``, started at its first function: not at all when every function is the
    project's own under ``reward.isolate=auto``) unless ``reward.isolate=false`` (``ThreadExecutor``).
    ``close()`` ends it."""

    def __init__(self, reward_spec: RewardSpec, executor: Optional[Any] = None, remote: bool = True):
        self.timeout_s = reward_spec.timeout_s
        isolate = getattr(reward_spec, "isolate", "auto")
        if executor is None:
            executor = (ThreadExecutor() if isolate is False
                        else ProcessExecutor(getattr(reward_spec, "memory_gb", None)))
        self.executor = executor
        # what runs in the driver's threads, the project's own code: the remote reward's client, and
        # with reward.isolate=auto the package's reward functions
        self._driver = ThreadExecutor()
        self.functions: list[RewardFunction] = []
        try:
            seen: dict[str, int] = {}
            for f in reward_spec.functions:
                base = f.name or f.fn.rpartition(":")[2]
                seen[base] = seen.get(base, 0) + 1
                name = base if seen[base] == 1 else f"{base}_{seen[base]}"
                if isolate == "auto" and project_function(f.fn):
                    fn = load_function(f.fn)
                    self.functions.append(RewardFunction(name, f.fn, fn, float(f.weight), takes=accepted(fn)))
                else:
                    self.functions.append(RewardFunction(name, f.fn, None, float(f.weight),
                                                         takes=self.executor.load(f.fn)))
        except BaseException:
            self.executor.close()
            raise
        remote = getattr(reward_spec, "remote", None) if remote else None
        if remote is not None:
            from rlhf.rewards.remote import RemoteReward

            client = RemoteReward(list(remote.urls), batch_size=remote.batch_size, concurrency=remote.concurrency,
                                  timeout_s=remote.timeout_s, retries=remote.retries)
            # no overall timeout: the client bounds each request (reward.remote.timeout_s, retries)
            self.functions.append(RewardFunction(remote.name, "reward.remote", client, float(remote.weight),
                                                 timeout_s=None, takes=accepted(client)))

    def score(self, prompts: list[str], responses: list[str], metadata: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted sum per sample, {function name: its raw values}). One call per function for
        all the samples; any failure is a ``RewardError`` (one line naming the function)."""
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
        kwargs = dict(metadata) if rf.takes is None else {k: v for k, v in metadata.items() if k in rf.takes}
        limit = self.timeout_s if rf.timeout_s == -1.0 else rf.timeout_s
        too_slow = RewardError(f"reward function {rf.ref} took more than reward.timeout_s={self.timeout_s} s on "
                               f"{len(responses)} samples. Make it faster or raise reward.timeout_s.")
        t0 = time.monotonic()
        executor = self._driver if rf.fn is not None else self.executor
        fut = executor.submit(rf, list(prompts), list(responses), kwargs)
        try:
            out = fut.result(timeout=limit)
        except RewardError:
            raise
        except UserError as e:  # the remote client's own lines
            raise RewardError(str(e)) from None
        except concurrent.futures.TimeoutError:
            raise too_slow from None
        except BaseException as e:  # noqa: BLE001 - sys.exit inside the function too
            raise RewardError(raised_message(rf.ref, e)) from None
        # a call that returned after its limit is over it too (with a tiny limit, the function may
        # finish before the wait starts)
        if limit is not None and time.monotonic() - t0 > limit:
            raise too_slow
        return check_values(rf.ref, to_floats(rf.ref, out), len(responses))

    def close(self) -> None:
        self.executor.close()


def score_samples(spec: RunSpec, rows: list[dict], samples: list[Sample], tokenizer, rewards: Rewards,
                  reward_model: Optional[ActorGroup], prompt_ids: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """Scores ``[len(samples)]``: the weighted reward functions on the decoded texts (with the rows'
    other columns as metadata) plus ``reward.model_weight`` × the reward model (``reward_model``,
    the cluster's group, None without one); and each part."""
    import torch  # here: the reward server and the preflight import this module without the trainer's stack

    # a prompt decoded once, not once per sample of its group
    texts = {i: tokenizer.decode(prompt_ids[i], skip_special_tokens=True) for i in {s.prompt_index for s in samples}}
    prompts = [texts[s.prompt_index] for s in samples]
    responses = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True) if samples else []
    keys = [k for k in rows[0] if k != spec.data.prompt_key]
    metadata = {k: [rows[s.prompt_index].get(k) for s in samples] for k in keys}
    metadata["finish_reasons"] = [s.finish_reason for s in samples]
    total, parts = rewards.score(prompts, responses, metadata) if rewards.functions else ([0.0] * len(samples), {})
    scores = torch.tensor(total, dtype=torch.float32)
    if reward_model is not None:
        from rlhf.data.batch import collate, dp_forward
        from rlhf.workers.frozen import RewardModelWorker

        batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                        tokenizer.pad_token_id, spec.rollout.max_response_tokens)
        rm = dp_forward(reward_model, RewardModelWorker.scores, batch)
        parts["model"] = rm.tolist()
        scores = scores + spec.reward.model_weight * rm
    return scores, parts
