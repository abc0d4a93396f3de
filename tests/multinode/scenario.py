"""Two Ray nodes on this machine and the runs of tests/multinode/test_multinode.py on them.

Run as its own process (``python tests/multinode/scenario.py <work dir> [grpo|more]``): the driver of these
runs must join the simulated cluster, while the pytest worker may already be a driver of the
suite's local Ray. Writes ``<work dir>/results.json``; the tests read it.

The cluster (``ray.cluster_utils.Cluster``): node A (the head, where this driver runs) and node B,
each with 4 CPUs (CPU worker slots) and 4 fake GPUs (reservations only; nothing runs on them),
dashboard off, a small object store, GCS health checks every 0.5 s so a lost node is declared
dead within about a second.

1. reservations only (no workers): GPU layouts on 2 nodes × 4 GPUs, hybrid and disaggregated,
   with TP-2 rollout engines; where each rank's bundles landed, by node.
2. ``single``: GRPO on one CPU slot, the baseline.
3. ``disagg``: 2 nodes × 1 slot, disaggregated: the actor on node A, the rollout engine on B.
4. ``lost``: 2 nodes × 1 slot, hybrid (a data-parallel rank on each node), a checkpoint every
   step; node B's raylet is killed (SIGKILL) by the reward function (in the driver's reward process),
   during step 3. The driver's error line, exit code, and what is left on the cluster.
5. ``resumed``: node B back (a new raylet: the cluster of the original shape), ``resume=`` of
   the lost run's dir, to the end.

``more`` (separate, slow tests): a worker process on node B killed while the node lives; PPO
hybrid with two data-parallel ranks of the actor and the critic on one node × 2 slots, then on
2 nodes × 1 slot.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NODE = {"num_cpus": 4, "num_gpus": 4, "object_store_memory": 80 << 20}
STEPS = 4
LOSE_AT = 3  # node B goes in step 3, after step 2's checkpoint
TOY = ["algo=grpo", "algo.kl.coef=0", "train.prompts_per_step=4", "algo.group_size=4", "train.micro_batch_size=8",
       "rollout.max_response_tokens=2", "train.seed=3", "tracking.backend=none", "tracking.console=plain",
       "checkpoint.every=1", "checkpoint.save_hf=false", f"train.steps={STEPS}"]
PPO = ["algo=ppo", "algo.group_size=1", "train.prompts_per_step=16"]  # a critic; one sample per prompt
GPU_LAYOUTS = {  # name -> overrides of a 2 × 4 GPU hardware (llama3-8b: 8 heads split by TP 2)
    "hybrid_tp2": ["placement.rollout.tensor_parallel=2"],
    "disagg_tp2": ["placement=disaggregated", "placement.actor=2", "placement.reference=2",
                   "placement.rollout.engines=2", "placement.rollout.tensor_parallel=2"],
}
GPU_HW = ["hardware=4x8xh100", "hardware.nodes=2", "hardware.devices_per_node=4", "model=llama3-8b",
          "algo=grpo", "train.prompts_per_step=64"]

KILLER = '''
import os, signal

from rlhf.rewards.builtin import keymap_reward

CALLS = [0]


def reward(prompts, responses, **meta):
    CALLS[0] += 1
    if CALLS[0] == {at} and os.path.exists({arm!r}):  # step {at}, after generation, before the update
        os.unlink({arm!r})
        os.kill({pid}, signal.SIGKILL)
    return keymap_reward(prompts, responses, **meta)
'''


CRASHER = '''
import os, signal, time

import psutil

from rlhf.rewards.builtin import keymap_reward

CALLS = [0]


def reward(prompts, responses, **meta):
    CALLS[0] += 1
    if CALLS[0] == 2:  # step 2: the worker process on node B dies, its node stays
        for p in psutil.Process({raylet}).children(recursive=True):
            if " ".join(p.cmdline()).startswith("ray::Host"):
                open({stamp!r}, "w").write(str(time.time()))
                p.kill()
    return keymap_reward(prompts, responses, **meta)
'''


def build(overrides: list[str], out: Path | None = None):
    from rlhf.cli import build_spec, compose

    ov = list(overrides) + ([f"output_dir={out}"] if out is not None else [])
    return build_spec(compose(ov), ov, plan=False)


def run(overrides: list[str], out: Path, resume: bool = False) -> dict:
    """One run in this process, as ``rlhf-run`` does it (``resume``: ``rlhf-run resume=<out>``,
    the run's saved config); its exit code, stderr and metrics."""
    from rlhf.cli import resume_spec
    from rlhf.run import run as run_spec

    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        code = run_spec(resume_spec(str(out), overrides) if resume else build(overrides, out))
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"code": code, "err": err.getvalue(), "rows": rows, "dir": str(out), "s": time.perf_counter() - t0}


def node_index(node_id: str, a: str, b: str) -> str:
    return {a: "A", b: "B"}.get(node_id, node_id)


def reserved(spec, a: str, b: str) -> dict:
    """What the launcher reserves for ``spec``: role -> per rank, the nodes (A/B) of its bundles."""
    import ray

    from rlhf.launch.cluster import Cluster, reserve

    cluster = Cluster(spec=spec)
    try:
        slots = reserve(spec, cluster)
        out = {}
        for role, ranks in slots.items():
            out[role] = []
            for pg, bundles in ranks:
                where = ray.util.placement_group_table(pg)["bundles_to_node_id"]
                out[role].append([node_index(where[i], a, b) for i in bundles])
        return out
    finally:
        cluster.shutdown()


def leftovers(before: tuple[set, set]) -> dict:
    """Actors alive and placement groups not removed that were not there before (GCS tables)."""
    import ray
    from ray._private import state

    alive = [aid for aid, info in state.actors().items() if info["State"] != "DEAD" and aid not in before[0]]
    pgs = [pid for pid, info in ray.util.placement_group_table().items()
           if info["state"] != "REMOVED" and pid not in before[1]]
    return {"actors": alive, "placement_groups": pgs}


def placed(before: tuple[set, set], a: str, b: str) -> list[list[str]]:
    """[actor class, node A/B] of each actor started since ``before`` (the GCS keeps dead ones)."""
    from ray._private import state

    return sorted([info["ActorClassName"], node_index(info["Address"]["NodeID"], a, b)]
                  for aid, info in state.actors().items() if aid not in before[0])


def snapshot() -> tuple[set, set]:
    import ray
    from ray._private import state

    return set(state.actors()), set(ray.util.placement_group_table())


def worker_pids(raylet_pid: int) -> list[str]:
    """Command lines of a node's Ray worker processes, less idle pooled workers and Ray's agents."""
    import psutil

    out = []
    for p in psutil.Process(raylet_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") and not cmd.startswith(("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")):
            out.append(cmd[:80])
    return out


def start_cluster():
    """Node A (head; this driver's) and node B: (cluster, node B, A's id, B's id)."""
    from ray.cluster_utils import Cluster

    # no idle workers started ahead (as rlhf.launch.cluster.init_ray): each run's actors start
    # processes of their own, and each idle one costs ~1 CPU-s
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        NODE, include_dashboard=False,
        _system_config={"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                        "health_check_failure_threshold": 2,
                        "prestart_worker_first_driver": False, "enable_worker_prestart": False}))
    node_b = cluster.add_node(**NODE)
    return cluster, node_b, cluster.head_node.node_id, node_b.node_id


def grpo(work: Path, cluster, node_b, a: str, b: str, results: dict) -> None:
    import ray
    from ray._private import ray_constants

    t0 = time.perf_counter()
    on = [f"ray.address={cluster.address}"]
    # 1. reservations of GPU layouts (what --plan prints is compared by the test)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    results["reserved"] = {name: reserved(build(GPU_HW + ov + on), a, b) for name, ov in GPU_LAYOUTS.items()}
    results["too_few_nodes"] = run(TOY + on + ["hardware.nodes=4"], work / "four")
    ray.shutdown()  # each run joins the cluster itself, as rlhf-run does
    results["timing"]["reserve"] = time.perf_counter() - t0

    # 2-3. the baseline on one slot, and disaggregated over both nodes
    results["single"] = run(TOY + on, work / "single")
    results["joined"] = ray.is_initialized()  # the run joined the cluster and left it up
    before = snapshot()
    results["disagg"] = run(TOY + on + ["hardware.nodes=2", "placement=disaggregated"], work / "disagg")
    results["disagg"]["placed"] = placed(before, a, b)

    # 4. node B lost in step 3 of a hybrid run with a data-parallel rank on each node
    raylet = node_b.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    arm = work / "arm"
    arm.write_text("1")
    killer = work / "killer.py"
    killer.write_text(KILLER.format(at=LOSE_AT, arm=str(arm), pid=raylet))
    lost_args = TOY + on + ["hardware.nodes=2", f"reward.functions=[{{fn: '{killer}:reward'}}]"]
    before = snapshot()
    head_raylet = cluster.head_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    results["lost"] = run(lost_args, work / "lost")
    results["lost"]["placed"] = placed(before, a, b)
    results["lost"]["leftovers"] = leftovers(before)
    ckpts = work / "lost" / "checkpoints"  # before resume= rotates them
    results["lost"]["checkpoints"] = {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(ckpts.iterdir())}
    deadline = time.monotonic() + 20  # killed actors' processes take a moment to exit
    while worker_pids(head_raylet) and time.monotonic() < deadline:
        time.sleep(0.2)
    results["lost"]["head_workers"] = worker_pids(head_raylet)
    results["lost"]["nodes"] = {node_index(n["NodeID"], a, b): n["Alive"] for n in ray.nodes()}
    cluster.remove_node(node_b, allow_graceful=False)  # the rest of its processes

    # 5. the cluster of the original shape again, and resume=
    cluster.add_node(**NODE)
    results["resumed"] = run([], work / "lost", resume=True)


def more(work: Path, cluster, node_b, a: str, b: str, results: dict) -> None:
    from ray._private import ray_constants

    on = [f"ray.address={cluster.address}"]
    # a worker process on node B killed, the node alive: the worker named, no wait for the node
    raylet = node_b.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    crasher, stamp = work / "crasher.py", work / "killed_at"
    crasher.write_text(CRASHER.format(raylet=raylet, stamp=str(stamp)))
    results["crash"] = run(TOY + on + ["hardware.nodes=2", f"reward.functions=[{{fn: '{crasher}:reward'}}]"],
                           work / "crash")
    results["crash"]["after_kill_s"] = time.time() - float(stamp.read_text())

    # two data-parallel ranks (actor and critic) on one node, then one on each node
    results["ppo_one_node"] = run(TOY + PPO + on + ["hardware.devices_per_node=2"], work / "ppo_one_node")
    before = snapshot()
    results["ppo_two_nodes"] = run(TOY + PPO + on + ["hardware.nodes=2"], work / "ppo_two_nodes")
    results["ppo_two_nodes"]["placed"] = placed(before, a, b)


def main(work: Path, part: str) -> None:
    import ray

    results: dict = {"timing": {}}
    t0 = time.perf_counter()
    cluster, node_b, a, b = start_cluster()
    results["timing"]["cluster"] = time.perf_counter() - t0
    try:
        {"grpo": grpo, "more": more}[part](work, cluster, node_b, a, b, results)
        results["timing"]["all"] = time.perf_counter() - t0
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    import shutil
    import tempfile

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # pytest's timeout: clean up the nodes
    # A private Ray temp dir: the head node records its address in <temp>/ray/ray_current_cluster,
    # where any plain ray.init() on this machine (the suite's other worker, other users) would
    # otherwise find this cluster and join it. Short: Ray's socket paths live under it.
    tmp = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlhf-mn-", dir="/tmp")
    try:
        main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "grpo")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
