"""``rlhf.launch.group`` with plain-Python ranks: the two-phase start, the rank order of calls and
scatters, and the colocated ``Host`` (CPU hybrid) with its ``RoleHandle``s, without Ray (``ray.get``
answers at once; a rank answers ``h.method.remote(...)`` itself)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rlhf.launch import group as launch_group
from rlhf.launch.group import ActorGroup, Host, RoleHandle


class _Rank:
    """A rank whose ``h.method.remote(*args)`` is logged and answered by ``method`` below."""

    def __init__(self, log: list, rank: int):
        self.log, self.rank = log, rank
        self._actor_id = f"actor{rank}"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return NS(remote=lambda *args, **kw: self._answer(name, args, kw))

    def _answer(self, name, args, kw):
        self.log.append((self.rank, name, args, kw))
        return ("10.0.0.1", 29500) if name == "address" else (self.rank, name, args)


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.setattr(launch_group.ray, "get", lambda refs: refs)
    log: list = []
    return log, ActorGroup("actor", [_Rank(log, r) for r in range(3)])


def test_start_asks_rank_0_for_the_address_then_every_rank_joins_it(ranks):
    log, group = ranks
    group.start()
    assert log == [(0, "address", (), {})] + [(r, "init_distributed", ("10.0.0.1", 29500), {}) for r in range(3)]


def test_call_and_scatter_answer_in_rank_order_and_shard_i_goes_to_rank_i(ranks):
    from rlhf.workers.policy import PolicyWorker

    log, group = ranks
    assert group.call(PolicyWorker.save_hf, "/out") == [(r, "save_hf", ("/out",)) for r in range(3)]
    shards = ["rows0", "rows1", "rows2"]
    assert group.scatter(PolicyWorker.update, shards, [4.0]) == [(r, "update", (shards[r], [4.0])) for r in range(3)]
    assert group.world_size == 3
    with pytest.raises(AssertionError):
        group.scatter(PolicyWorker.update, shards[:2], [4.0])  # one shard per rank


class _Worker:
    """A role's worker object inside a Host."""

    def __init__(self, spec, role, rank, world_size):
        self.where = (spec, role, rank, world_size)

    def describe(self, suffix=""):
        return "/".join(map(str, self.where)) + suffix


def test_a_host_holds_one_worker_per_role_and_counts_what_is_left():
    host = Host("spec", 1, 2, {"actor": (__name__, "_Worker"), "rollout": (__name__, "_Worker")})
    assert host.call("actor", "describe", suffix="!") == "spec/actor/1/2!"
    assert host.call("rollout", "describe") == "spec/rollout/1/2"
    assert host.release("actor") == 1 and set(host.workers) == {"rollout"}
    assert host.release("rollout") == 0


def test_role_handles_reach_their_role_on_the_shared_host_and_release_kills_the_empty_host(monkeypatch):
    monkeypatch.setattr(launch_group.ray, "get", lambda refs: refs)
    killed = []
    monkeypatch.setattr(launch_group.ray, "kill", lambda actor, no_restart: killed.append(actor._actor_id))
    hosts = []
    for d in range(2):  # a Ray actor handle's shape: host.method.remote(...) runs the Host's method
        real = Host("spec", d, 2, {"actor": (__name__, "_Worker"), "reference": (__name__, "_Worker")})
        hosts.append(NS(_actor_id=f"host{d}", call=NS(remote=real.call), release=NS(remote=real.release)))
    actor = ActorGroup("actor", [RoleHandle(h, "actor") for h in hosts])
    reference = ActorGroup("reference", [RoleHandle(h, "reference") for h in hosts])
    assert actor.call(_Worker.describe) == ["spec/actor/0/2", "spec/actor/1/2"]
    assert reference.scatter("describe", ["-a", "-b"]) == ["spec/reference/0/2-a", "spec/reference/1/2-b"]
    reference.release()  # DPO drops its reference mid-run: the hosts live on with the actor
    assert killed == [] and reference.workers == []
    actor.release()
    assert killed == ["host0", "host1"]


def test_a_released_groups_processes_give_their_memory_back_before_they_are_killed(monkeypatch):
    """Separate worker processes (GPU placements): ray.kill returns before a process exits, so
    release first waits for each worker to drop its models, then kills it."""
    events = []
    monkeypatch.setattr(launch_group.ray, "get", lambda refs: events.append(("waited", list(refs))) or refs)
    monkeypatch.setattr(launch_group.ray, "kill", lambda actor, no_restart: events.append(("killed", actor.name)))
    workers = [NS(name=f"ref{r}", drop_models=NS(remote=lambda r=r: events.append(("dropped", r)) or f"done{r}"))
               for r in range(2)]
    group = ActorGroup("reference", workers)
    group.release()
    assert events == [("dropped", 0), ("dropped", 1), ("waited", ["done0", "done1"]),
                      ("killed", "ref0"), ("killed", "ref1")]
    assert group.workers == []


def test_a_worker_drops_its_models_and_keeps_what_it_is():
    """What release asks of a worker: every module it holds goes (a DeepSpeed engine is one), the
    rest of it stays."""
    import torch

    from rlhf.workers.base import Worker

    w = object.__new__(Worker)
    w.device, w.role, w.module, w.head = "cpu", "reference", torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    w.temperature = 1.0
    w.drop_models()
    assert not hasattr(w, "module") and not hasattr(w, "head")
    assert (w.role, w.temperature) == ("reference", 1.0)
