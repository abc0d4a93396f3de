"""The hybrid memory schedule (``rlhf.workers.schedule``) and typed worker calls
(``rlhf.launch.group.ActorGroup`` with method references), without Ray: every rank is a handle
that records the calls it gets, so the order the schedule issues them in is checked on CPU even
though the GPU path itself (vLLM sleep, DeepSpeed offload) needs a GPU."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rlhf.launch.group import ActorGroup, RoleHandle
from rlhf.workers.schedule import make_schedule
from rlhf.workers.policy import PolicyWorker


class _Handle:
    """One rank of a role: ``h.method.remote(*args)`` is logged and answers like the worker would."""

    def __init__(self, log: list, role: str, rank: int):
        self.log, self.role, self.rank = log, role, rank

    def __getattr__(self, method: str):
        if method.startswith("__"):
            raise AttributeError(method)
        return NS(remote=lambda *args: self._answer(method, args))

    def _answer(self, method: str, args: tuple):
        self.log.append((self.role, method, args) if self.rank == 0 else None)
        if method == "engine_wake":
            return 0.1 * (self.rank + 1)
        if method == "gpu_sync_setup":
            return 0.5 if self.rank == 0 else 1.5  # the last rank is the slowest here: its figure is the wait
        if method == "gpu_sync_send":
            return {"sync_seconds": 2.0, "sync_bytes": 8.0} if self.rank == 0 else None
        if method == "full_state_dict":
            return "weights" if self.rank == 0 else None
        if method == "release_cuda_cache":
            return {f"memory/{self.role}_peak_reserved_gib": 10.0 + self.rank, f"memory/{self.role}_resident_gib":
                    2.0 + self.rank}
        if method == "memory_peaks":
            return {f"memory/{self.role}_peak_reserved_gib": 20.0 + self.rank}
        if method in ("engine_sleep", "offload_train_states", "reload_train_states"):
            return {f"{method}/{self.role}": float(self.rank), "memory/shared": float(len(self.role))}
        return None


def _layout(mode: str):
    from rlhf.placement import registry
    from rlhf.placement.layout import Layout

    roles = ("actor", "critic", "reference", "rollout")
    return Layout(mode=mode, total_devices=2, roles={}, engines=((0,), (1,)), pools=registry.get(mode).pools(roles))


@pytest.fixture
def run(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the handles answer at once

    def run(device="cuda", mode="hybrid", sleep=True, offload=True, critic=True):
        log: list = []
        group = lambda role: ActorGroup(role, [_Handle(log, role, r) for r in range(2)])  # noqa: E731
        spec = NS(device=device, rollout_engine="vllm" if device == "cuda" else "hf", rollout=NS(plugins=()),
                  layout=_layout(mode),
                  placement=NS(sleep_rollout=sleep, offload_train_state=offload))
        cluster = NS(actor=group("actor"), critic=group("critic") if critic else None, reference=group("reference"),
                     teacher=None, reward_model=None, rollout=group("rollout"))
        schedule = make_schedule(spec, cluster)
        start = [c for c in log if c]
        log.clear()
        train = schedule.to_train()
        to_train = [c for c in log if c]
        log.clear()
        gen = schedule.to_generate()
        return start, to_train, [c for c in log if c], train, gen, schedule.weights.setup_metrics

    return run


def test_hybrid_gpu_moves_memory_around_the_send_in_order(run):
    start, to_train, to_generate, train, gen, setup = run()
    assert [m for _, m, _ in start] == ["gpu_sync_setup", "offload_train_states", "offload_train_states"]
    assert setup == {"sync/setup_seconds": 1.5}  # the slowest rank's: the ranks set up at once
    assert to_train == [("rollout", "engine_sleep", (2,)), ("actor", "reload_train_states", ()),
                        ("critic", "reload_train_states", ())]
    assert to_generate == [
        # every model's cached activations go back before vLLM's weights wake (the trained roles'
        # too: their offload comes only after the send)
        ("actor", "release_cuda_cache", ()), ("critic", "release_cuda_cache", ()),
        ("reference", "release_cuda_cache", ()),
        ("rollout", "engine_wake", (["weights"],)),
        ("actor", "gpu_sync_send", (512,)),
        ("actor", "offload_train_states", ()), ("critic", "offload_train_states", ()),
        ("rollout", "engine_wake", (["kv_cache"],)),
    ]
    # means over ranks; the actor's figures win on a name both trained roles report
    assert train["engine_sleep/rollout"] == 0.5 and train["memory/shared"] == len("actor")
    assert gen["time/wake_weights"] == pytest.approx(0.2) and gen["time/wake_kv_cache"] == pytest.approx(0.2)
    assert gen["sync/seconds"] == 2.0 and gen["sync/bytes"] == 8.0
    # a memory peak is the largest rank's (a rank runs out on its own peak); other figures the mean
    assert gen["memory/actor_peak_reserved_gib"] == 11.0 and gen["memory/reference_peak_reserved_gib"] == 11.0
    assert gen["memory/actor_resident_gib"] == 2.5


def test_hybrid_gpu_with_resident_train_states_frees_every_cache(run):
    start, to_train, to_generate, _, _, _ = run(offload=False, critic=False)
    assert [m for _, m, _ in start] == ["gpu_sync_setup"]
    assert to_train == [("rollout", "engine_sleep", (2,))]
    assert [(r, m) for r, m, _ in to_generate] == [
        ("actor", "release_cuda_cache"), ("reference", "release_cuda_cache"), ("rollout", "engine_wake"),
        ("actor", "gpu_sync_send"), ("rollout", "engine_wake")]


def test_hybrid_gpu_with_the_engine_awake_moves_no_state(run):
    # the engine awake through the update (async rollouts, or the plan's room for it: placement.sleep_rollout
    # and offload_train_state resolved to false): nothing sleeps, wakes or leaves, and no cache is
    # emptied for it (the next passes reuse it); the memory peaks are still read; the send is all that moves
    start, to_train, to_generate, train, gen, _ = run(sleep=False, offload=False)
    assert [m for _, m, _ in start] == ["gpu_sync_setup"]
    assert to_train == [] and train == {}
    assert [(r, m) for r, m, _ in to_generate] == [
        ("actor", "memory_peaks"), ("critic", "memory_peaks"), ("reference", "memory_peaks"),
        ("actor", "gpu_sync_send")]
    assert "time/wake_weights" not in gen and "time/wake_kv_cache" not in gen
    assert gen["memory/actor_peak_reserved_gib"] == 21.0 and gen["memory/reference_peak_reserved_gib"] == 21.0


@pytest.mark.parametrize("device,mode", [("cuda", "disaggregated"), ("cpu", "hybrid"), ("cpu", "disaggregated")])
def test_elsewhere_only_the_weights_move(run, device, mode):
    start, to_train, to_generate, train, gen, setup = run(device=device, mode=mode)
    assert to_train == [] and train == {}
    assert setup == ({"sync/setup_seconds": 1.5} if device == "cuda" else {})  # the object store sets up nothing
    send = ["gpu_sync_send"] if device == "cuda" else ["full_state_dict", "load_weights"]
    assert [m for _, m, _ in to_generate] == send
    assert [m for _, m, _ in start] == (["gpu_sync_setup"] if device == "cuda" else [])


def test_a_method_reference_reaches_a_colocated_role_by_its_name():
    calls = []
    host = NS(_actor_id="host-0", call=NS(remote=lambda role, method, *a: calls.append((role, method, a))))
    group = ActorGroup("actor", [RoleHandle(host, "actor")])
    group.call_async(PolicyWorker.save_hf, "/tmp/x")
    group.scatter_async(PolicyWorker.update, [{"rows": 1}], [4.0])
    group.call_async("ping")  # a name still works
    assert calls == [("actor", "save_hf", ("/tmp/x",)), ("actor", "update", ({"rows": 1}, [4.0])),
                     ("actor", "ping", ())]


class _FakeHost:
    """A colocated host's Ray handle: ``relay.remote(...)`` and ``call.remote(...)`` are logged."""

    def __init__(self, name: str, log: list):
        self._actor_id, self.log = name, log
        self.relay = NS(remote=lambda *args: log.append((name, "relay", args)))
        self.call = NS(remote=lambda role, method, *args: log.append((name, role, method)) or (
            "weights" if method == "full_state_dict" else None))


@pytest.mark.parametrize("hosts,ranks", [(("h0", "h0"), 1), (("h0", "h1"), 1), (("h0", "h0"), 2)])
def test_one_host_holding_actor_and_engine_relays_the_weights_itself(monkeypatch, hosts, ranks):
    """The actor's only rank and the only engine on one CPU host: one call, the host hands the state
    dict over in its process. Different hosts, or more ranks: the state dict goes through Ray."""
    import ray

    from rlhf.workers.schedule import ObjectStoreTransport

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    log: list = []
    host = {name: _FakeHost(name, log) for name in set(hosts)}
    actor = ActorGroup("actor", [RoleHandle(host[hosts[0]], "actor")] * ranks)
    rollout = ActorGroup("rollout", [RoleHandle(host[hosts[1]], "rollout")] * ranks)
    assert ObjectStoreTransport(actor, rollout).send() == {}
    if hosts == ("h0", "h0") and ranks == 1:
        assert log == [("h0", "relay", ("actor", "full_state_dict", "rollout", "load_weights"))]
    else:
        assert [m for _, _, m in log] == ["full_state_dict"] * ranks + ["load_weights"] * ranks


def test_a_hosts_relay_hands_one_roles_result_to_another():
    from rlhf.launch.group import Host

    got = []
    host = Host.__new__(Host)  # the roles' worker objects without their models
    host.workers = {"actor": NS(full_state_dict=lambda: {"w": 1}), "rollout": NS(load_weights=got.append)}
    assert host.relay("actor", "full_state_dict", "rollout", "load_weights") is None
    assert got == [{"w": 1}]
