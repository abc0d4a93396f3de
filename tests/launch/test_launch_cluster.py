"""The launcher's reservations and placements (``rlhf.launch.cluster``) from built specs, without
a Ray cluster: placement groups, actor spawns and Ray's node list are stand-ins that record what
they are asked for. What Ray then does with a reservation is covered by the end-to-end runs
(tests/rl) and the two-node scenario (tests/multinode)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rlhf.launch import cluster as launch
from rlhf.launch.group import ActorGroup, RoleHandle, can_colocate, worker_env
from rlhf.spec.errors import UserError
from tests.helpers import planned_spec

GPU = ["hardware=8xh100", "model=llama3-8b"]


def _spec(overrides):
    return planned_spec(overrides)


@pytest.fixture
def ray_stand_in(monkeypatch):
    """Placement groups record their bundles; ``ray.get`` answers at once."""
    made = []

    def placement_group(bundles, strategy, **kwargs):
        pg = NS(index=len(made), bundles=bundles, strategy=strategy, kwargs=kwargs, ready=lambda: "ready")
        made.append(pg)
        return pg

    monkeypatch.setattr(launch, "placement_group", placement_group)
    monkeypatch.setattr(launch.ray, "get", lambda refs, timeout=None: refs)
    return made


def test_hybrid_reserves_one_group_with_every_role_on_every_device(ray_stand_in):
    spec = _spec(["algo=ppo", *GPU, "placement.rollout.tensor_parallel=2"])
    slots = launch.reserve(spec, launch.Cluster(spec=spec))
    (pg,) = ray_stand_in
    assert pg.bundles == [{"GPU": 1.0, "CPU": 1.0}] * 8 and pg.strategy == "PACK" and pg.kwargs == {}
    for role in ("actor", "critic", "reference"):
        assert slots[role] == [(pg, (d,)) for d in range(8)]
    assert slots["rollout"] == [(pg, (0, 1)), (pg, (2, 3)), (pg, (4, 5)), (pg, (6, 7))]  # TP groups


def test_disaggregated_reserves_a_group_per_role_over_its_own_devices(ray_stand_in):
    spec = _spec(["algo=ppo", *GPU, "placement=disaggregated"])
    slots = launch.reserve(spec, launch.Cluster(spec=spec))
    groups = {role: {pg.index for pg, _ in ranks} for role, ranks in slots.items()}
    assert all(len(g) == 1 for g in groups.values()) and len({g.pop() for g in groups.values()}) == 4
    sizes = {role: len(ranks[0][0].bundles) for role, ranks in slots.items()}
    assert sizes == {r: len(spec.layout.roles[r]) for r in spec.roles}
    assert sum(sizes.values()) == 8  # no device twice
    assert [b for _, b in slots["actor"]] == [(i,) for i in range(len(spec.layout.roles["actor"]))]


def test_bundles_of_a_cpu_run_are_worker_slots(ray_stand_in):
    spec = _spec(["algo=grpo", "placement=disaggregated", "hardware.devices_per_node=3"])
    launch.reserve(spec, launch.Cluster(spec=spec))
    assert [pg.bundles for pg in ray_stand_in] == [[{"CPU": 1.0}]] * 3


@pytest.fixture
def spawned(monkeypatch, ray_stand_in):
    """``_place`` with the actor spawns recorded: role -> (worker class, bundles, resources, each
    rank's further constructor arguments)."""
    out: dict = {}

    def spawn(cls, worker_cls, spec, role, slots, resources, args=None):
        out[role] = (worker_cls.__name__, [b for _, b in slots], resources, args)
        return ActorGroup(role, [f"{role}{i}" for i in range(len(slots))])

    monkeypatch.setattr(ActorGroup, "spawn", classmethod(spawn))
    hosts: list = []
    monkeypatch.setattr(launch, "spawn_actor", lambda cls, spec, pg, bundle, res, *args: hosts.append(
        (cls.__name__, bundle, res, args[:2])) or NS(_actor_id=f"host{bundle}"))
    return out, hosts


def test_hybrid_gpu_roles_share_each_device_equally(spawned):
    out, hosts = spawned
    spec = _spec(["algo=ppo", *GPU])
    cluster = launch.Cluster(spec=spec)
    launch._place(spec, cluster)
    assert hosts == []
    assert {r: res for r, (_, _, res, _) in out.items()} == {r: {"GPU": 0.25, "CPU": 0.25} for r in spec.roles}
    assert out["actor"][0] == "PolicyWorker" and out["critic"][0] == "CriticWorker"
    assert out["reference"][0] == "ReferenceWorker" and out["rollout"][0] == "RolloutWorker"


def test_disaggregated_gpu_roles_take_whole_devices(spawned):
    out, _ = spawned
    spec = _spec(["algo=ppo", *GPU, "placement=disaggregated"])
    launch._place(spec, launch.Cluster(spec=spec))
    assert all(res == {"GPU": 1.0, "CPU": 1.0} for _, _, res, _ in out.values())


def test_cpu_hybrid_puts_every_role_of_a_device_in_one_host(spawned):
    out, hosts = spawned
    spec = _spec(["algo=ppo"])
    assert can_colocate(spec)
    cluster = launch.Cluster(spec=spec, started_ray=True)  # rlhf-run's own Ray: no host is kept after the run
    launch._place(spec, cluster)
    assert out == {} and hosts == [("Host", 0, {"CPU": 1.0}, (0, 1))]  # in the placement group's bundle
    assert set(cluster.groups) == set(spec.roles) and cluster.pooled == []
    for role, group in cluster.groups.items():
        (handle,) = group.workers
        assert isinstance(handle, RoleHandle) and handle.role == role and handle._actor_id == "host0"


def test_hosts_that_may_be_kept_come_from_the_pool_beside_the_placement_group(spawned, monkeypatch):
    """A Ray the driver joined (started_ray False), one node: the hosts come from rlhf.launch.pool,
    which starts (or reuses) them outside the placement group; the group still reserves the slots."""
    from rlhf.launch import pool

    out, hosts = spawned
    asked = []
    monkeypatch.setattr(pool, "usable", lambda spec, started_ray: not started_ray)
    monkeypatch.setattr(pool, "take", lambda spec, n, roles: asked.append((n, sorted(roles))) or
                        [NS(_actor_id=f"kept{i}") for i in range(n)])
    spec = _spec(["algo=grpo", "hardware.devices_per_node=2"])
    cluster = launch.Cluster(spec=spec)
    launch._place(spec, cluster)
    assert hosts == [] and out == {} and asked == [(2, sorted(spec.roles))]
    assert [pg.bundles for pg in cluster.placement_groups] == [[{"CPU": 1.0}] * 2]
    assert [h._actor_id for h in cluster.pooled] == ["kept0", "kept1"]
    assert [w._actor_id for w in cluster.groups["actor"].workers] == ["kept0", "kept1"]


@pytest.mark.parametrize("overrides,started_ray,why", [
    (["ray.reuse_workers=false"], False, "switched off"),
    ([], True, "the driver started Ray: it ends with the run"),
    (["placement=disaggregated", "hardware.devices_per_node=3"], False, "a process per role"),
    (["algo.async_steps=1", "algo.tis_cap=2.0"], False, "async rollouts"),
    (GPU, False, "GPU"),
    (["hardware.nodes=2"], False, "several nodes"),
])
def test_hosts_are_not_kept(overrides, started_ray, why):
    from rlhf.launch import pool

    assert not pool.usable(_spec(["algo=grpo", *overrides]), started_ray), why


@pytest.mark.parametrize("overrides", [["placement=disaggregated", "hardware.devices_per_node=3"],
                                       ["algo.async_steps=1", "algo.tis_cap=2.0"], [*GPU]])
def test_a_process_per_role_elsewhere(overrides):
    assert not can_colocate(_spec(["algo=grpo", *overrides]))


def test_workers_get_the_device_settings_and_stay_offline_without_hub_models(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cpu, gpu = worker_env(_spec(["algo=grpo"])), worker_env(_spec(["algo=grpo", *GPU]))
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["OMP_NUM_THREADS"] == "1" and cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert gpu["DS_ACCELERATOR"] == "cuda" and "OMP_NUM_THREADS" not in gpu and "CUDA_VISIBLE_DEVICES" not in gpu
    assert cpu["HF_HUB_OFFLINE"] == "1"
    hub = NS(device="cpu", models={"model": NS(repo="org/model")})
    assert worker_env(hub)["HF_HUB_OFFLINE"] == "0"


def _node(node_id, address, gpus, cpus=64.0, alive=True):
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
            "Resources": {"GPU": gpus, "CPU": cpus}}


def test_plan_nodes_are_the_drivers_first_then_by_address(monkeypatch):
    spec = _spec(["algo=grpo", "hardware=4x8xh100", "model=llama3-70b"])
    nodes = [_node("d", "10.0.0.9", 8), _node("c", "10.0.0.3", 8), _node("small", "10.0.0.1", 4),
             _node("dead", "10.0.0.2", 8, alive=False), _node("b", "10.0.0.5", 8), _node("a", "10.0.0.4", 8)]
    monkeypatch.setattr(launch.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(launch.ray, "get_runtime_context", lambda: NS(get_node_id=lambda: "d"))
    assert launch.ray_nodes(spec) == ["d", "c", "a", "b"]
    monkeypatch.setattr(launch.ray, "nodes", lambda: nodes[:3])
    with pytest.raises(UserError, match=r"needs 4 nodes with 8 GPUs and 8 CPUs each, but the Ray cluster has 2 "
                                        r"such nodes .*hardware.nodes=2"):
        launch.ray_nodes(spec)


# TP > 1 vLLM engines: 2 engines × TP 2, in hybrid placement on 4 GPUs, and disaggregated on 8 (4 GPUs
# cannot hold them beside an actor) and on 4 with one engine.
SMALL = ["algo=grpo", "model=qwen2.5-0.5b", "hardware=8xh100", "placement.rollout.tensor_parallel=2"]
TP_LAYOUTS = {
    "hybrid-4": [*SMALL, "hardware.devices_per_node=4"],
    "disaggregated-8": [*SMALL, "placement=disaggregated", "placement.rollout.engines=2"],
    "disaggregated-4": [*SMALL, "hardware.devices_per_node=4", "placement=disaggregated", "placement.rollout.engines=1"],
}


@pytest.mark.parametrize("name", TP_LAYOUTS)
def test_each_tp_engine_gets_the_bundles_of_its_own_gpus(name):
    from rlhf.plan.render import render_plan

    spec = _spec(TP_LAYOUTS[name])
    lay, groups, engines = spec.layout, launch.group_devices(spec), launch.placement(spec)["rollout"]
    assert len(engines) == (1 if name == "disaggregated-4" else 2) and lay.rollout_tp == 2
    plan, taken = render_plan(spec), set()
    for i, slot in enumerate(engines):
        bundles = slot.engine["bundle_indices"]
        assert len(bundles) == 2 and bundles[0] == slot.bundles[0]  # the engine's process sits on its first
        devices = tuple(groups[slot.group][b] for b in bundles)
        assert devices == lay.engines[i]
        assert f"device {devices[0]}-{devices[1]}: vllm engine {i} (TP 2)" in plan
        assert taken.isdisjoint((slot.group, b) for b in bundles)
        taken.update((slot.group, b) for b in bundles)
        assert slot.resources["GPU"] == 0.0  # vLLM's TP workers hold the GPUs, not the engine's process
    if lay.mode == "disaggregated":
        assert groups["rollout"] == tuple(d for e in lay.engines for d in e)
        assert [s.engine["gpu_share"] for s in engines] == [1.0] * len(engines)


@pytest.mark.parametrize("name", TP_LAYOUTS)
def test_every_bundle_holds_what_is_asked_of_it(name):
    """What the processes and vLLM's TP workers take of each bundle fits in it: in hybrid
    placement the roles and the engines' TP workers fill each GPU exactly."""
    spec = _spec(TP_LAYOUTS[name])
    gpu: dict = {}
    cpu: dict = {}
    for slots in launch.placement(spec).values():
        for s in slots:
            gpu[s.group, s.bundles[0]] = gpu.get((s.group, s.bundles[0]), 0.0) + s.resources.get("GPU", 0.0)
            cpu[s.group, s.bundles[0]] = cpu.get((s.group, s.bundles[0]), 0.0) + s.resources["CPU"]
            for b in s.engine.get("bundle_indices", ()):
                gpu[s.group, b] = gpu.get((s.group, b), 0.0) + s.engine["gpu_share"]
    bundles = {(g, b) for g, devs in launch.group_devices(spec).items() for b in range(len(devs))}
    assert set(gpu) == bundles
    assert all(v == pytest.approx(1.0) for v in gpu.values()), gpu
    assert all(v <= 1.0 + 1e-9 for v in cpu.values()), cpu


def test_the_launcher_hands_each_tp_engine_its_bundles(spawned):
    out, _ = spawned
    base = [*SMALL[:-1], "hardware.devices_per_node=4"]
    spec = _spec([*base, "placement.rollout.tensor_parallel=2"])
    launch._place(spec, launch.Cluster(spec=spec))
    assert out["rollout"] == ("RolloutWorker", [0, 2], {"GPU": 0.0, "CPU": 1 / 3},
                              [({"bundle_indices": (0, 1), "gpu_share": 1 / 3},),
                               ({"bundle_indices": (2, 3), "gpu_share": 1 / 3},)])
    assert all(a is None for role, (_, _, _, a) in out.items() if role != "rollout")
    spec = _spec([*base, "placement.rollout.engines_per_device=1"])  # TP 1: an engine in its own process on its one device
    launch._place(spec, launch.Cluster(spec=spec))
    assert out["rollout"] == ("RolloutWorker", [0, 1, 2, 3], {"GPU": 1 / 3, "CPU": 1 / 3}, None)


def test_engines_that_share_a_device_take_a_share_each_and_start_in_waves(spawned):
    """Two engines per GPU (placement.rollout.engines_per_device=2, the opt-in): each a process of its
    own on its device's bundle, a quarter of it beside the actor's and the reference's; vLLM's start
    one after another on a device (it sizes its KV cache from the free memory), every device's first
    engine at once."""
    out, _ = spawned
    spec = _spec([*SMALL[:-1], "hardware.devices_per_node=4", "placement.rollout.engines_per_device=2"])
    assert spec.layout.engines == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    launch._place(spec, launch.Cluster(spec=spec))
    assert out["rollout"] == ("RolloutWorker", [0, 0, 1, 1, 2, 2, 3, 3], {"GPU": 1 / 4, "CPU": 1 / 4}, None)
    assert out["actor"][2] == {"GPU": 1 / 4, "CPU": 1 / 4}
    assert launch.start_waves(spec) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # an engine that sizes nothing from the free memory starts all at once
    hf = _spec([*SMALL[:-1], "hardware.devices_per_node=4", "rollout.engine=hf", "placement.rollout.engines_per_device=2"])
    assert launch.start_waves(hf) == [list(range(8))]


def test_disaggregated_engines_on_one_device_share_its_bundle(ray_stand_in):
    spec = _spec(["algo=grpo", "placement=disaggregated", "hardware.devices_per_node=4",
                  "placement.rollout.engines_per_device=2"])
    slots = launch.reserve(spec, launch.Cluster(spec=spec))
    rollout_pg = slots["rollout"][0][0]
    assert rollout_pg.bundles == [{"CPU": 1.0}]  # one device, reserved once
    assert slots["rollout"] == [(rollout_pg, (0,)), (rollout_pg, (0,))]
    assert launch.placement(spec)["rollout"][0].resources == {"CPU": 0.5}


def test_a_tp_engine_starts_vllm_on_its_bundles(monkeypatch):
    """The launcher's settings through the rollout worker to vLLM: ``VLLM_RAY_BUNDLE_INDICES``
    and the Ray executor (vLLM is a stand-in that records its arguments)."""
    import os
    import sys
    import types

    import torch

    import rlhf.models
    from rlhf.workers import base
    from rlhf.workers.rollout import RolloutWorker

    made = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: made.append(kw)))
    monkeypatch.setattr(rlhf.models, "model_dir", lambda spec: "/m")
    monkeypatch.setattr(rlhf.models, "load_tokenizer", lambda path: NS(eos_token_id=2))
    monkeypatch.setattr(base, "skip_unused_imports", lambda: None)  # it hides mlflow from this process
    monkeypatch.delenv("RLHF_VLLM_ARGS", raising=False)
    for key in ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(key, "")  # restored (unset) after the test
    spec = _spec(TP_LAYOUTS["disaggregated-8"])
    engines = launch.placement(spec)["rollout"]
    for rank, slot in enumerate(engines):
        with torch.random.fork_rng():
            worker = RolloutWorker(spec, "rollout", rank, len(engines), slot.engine)
        worker.setup()
        assert made[-1]["tensor_parallel_size"] == 2 and made[-1]["distributed_executor_backend"] == "ray"
        assert os.environ["VLLM_RAY_BUNDLE_INDICES"] == ",".join(map(str, slot.bundles))
        assert float(os.environ["VLLM_RAY_PER_WORKER_GPUS"]) == 1.0
    assert spec.layout.engines == ((4, 5), (6, 7)) and [e.bundles for e in engines] == [(0, 1), (2, 3)]
