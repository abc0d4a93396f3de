"""Host processes kept across in-process runs (``rlhf.launch.pool``, ``ray.reuse_workers``): a run
on a reused host gives the same numbers, bit for bit, as on a new one, and reuse really happens.

Four toy runs on the tests' shared Ray, in order: A (dr_grpo, one slot: actor and rollout only),
then B (grpo, two slots: reference too, world size 2), which gets A's host as rank 0 and a new
process for rank 1, then C (B again), which gets both of B's hosts, and F (B again with
``ray.reuse_workers=false``): two new processes inside the placement group, as before the pool.
B, C and F must agree on every metric that is not a clock reading, and on the final weights' bytes.
A failed run's hosts are never kept: tests/rl/test_rl_runs.py::test_no_leftovers_after_failing_run.
"""

from __future__ import annotations

import pytest

from tests.helpers import host_pids, leftovers, run_rl, snapshot

TOY = ["train.prompts_per_step=16", "rollout.max_response_tokens=4", "tracking=none", "train.steps=2"]
A = TOY + ["algo=dr_grpo", "train.seed=3"]
B = TOY + ["algo=grpo", "train.seed=1", "hardware.devices_per_node=2"]
CLOCKS = ("time/", "throughput/", "perf/update_tflops", "perf/fwd_bwd_tflops")  # wall-clock readings


def numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(CLOCKS)} for r in rows]


@pytest.fixture(scope="module")
def runs(rl_env, tmp_path_factory):
    from rlhf.launch import pool

    pool.drain()  # the hosts other files' runs left idle in this process: A starts from a known pool
    out = tmp_path_factory.mktemp("reuse")
    res = {}
    for name, overrides in [("A", A), ("B", B), ("C", B), ("F", B + ["ray.reuse_workers=false"])]:
        before = snapshot()
        code, rows = run_rl(overrides, out / name)
        res[name] = {"code": code, "rows": rows, "dir": out / name, "pids": host_pids(out / name),
                     "left": leftovers(*before), "idle": len(pool.idle_hosts())}
    return res


def test_runs_reuse_the_hosts_of_the_runs_before(runs):
    a, b, c, f = (runs[n] for n in "ABCF")
    assert [r["code"] for r in (a, b, c, f)] == [0] * 4
    assert b["pids"][0] == a["pids"][0] and b["pids"][1] != a["pids"][0]  # A's host, and one new
    assert set(c["pids"].values()) == set(b["pids"].values())  # both of B's (each may hold the other's rank now)
    assert set(f["pids"].values()).isdisjoint(b["pids"].values())  # reuse_workers=false: new processes
    # after each run its hosts wait idle (F's were killed: they sat in its placement group); nothing else is left
    assert [r["idle"] for r in (a, b, c, f)] == [1, 2, 2, 2]
    assert all(r["left"] == ([], []) for r in (a, b, c, f))


def test_a_reused_host_gives_the_same_numbers_as_a_new_one(runs):
    b, c, f = runs["B"], runs["C"], runs["F"]
    assert len(b["rows"]) == 2 and numbers(b["rows"]) == numbers(f["rows"]) == numbers(c["rows"])
    assert b["rows"][1]["actor/grad_norm"] > 0 and b["rows"][1]["kl/mean"] != 0  # the runs trained
    weights = {n: sorted((p.name, p.read_bytes()) for p in (runs[n]["dir"] / "final" / "hf").glob("*.safetensors"))
               for n in "BCF"}
    assert weights["B"] and weights["B"] == weights["C"] == weights["F"]


def test_an_idle_host_writes_nothing_into_the_finished_runs_logs(runs):
    """A retired host's output goes back to Ray's own log files of the process: what an idle host
    prints lands in no file of the runs it served."""
    import ray

    from rlhf.launch import pool

    hosts = pool.idle_hosts()
    assert sorted(ray.get([h.idle.remote() for h in hosts])) == sorted(runs["C"]["pids"].values())
    ray.get([h.__ray_call__.remote(lambda self: print("idle-host-marker", flush=True)) for h in hosts])
    for name in "BC":
        for log in (runs[name]["dir"] / "logs").glob("*.log"):
            assert "idle-host-marker" not in log.read_text(), log
