"""A dead worker on a GPU run: one line naming its role, rank and GPU(s) (a stand-in cluster and
Ray's own RayActorError; no Ray cluster, no GPU). Errors raised inside live workers (a dead vLLM
engine core, a collective timeout): tests/reliability/test_worker_failures.py."""

from types import SimpleNamespace

import pytest

from tests.helpers import planned_spec


class _Handle:
    def __init__(self, hex_id):
        self._actor_id = SimpleNamespace(hex=lambda: hex_id)


@pytest.mark.parametrize("role", ["rollout", "actor"])
def test_dead_worker_names_role_rank_and_gpus(role, tmp_path):
    from ray.exceptions import RayActorError

    from rlhf.launch.failures import worker_failure

    spec = planned_spec(["model=qwen2.5-7b", "hardware=8xh100", "placement=disaggregated", "placement.actor=4",
                  "placement.reference=0", "algo.kl.coef=0", "placement.rollout.engines=1",
                  "placement.rollout.tensor_parallel=4", f"output_dir={tmp_path}", "model.path=/nonexistent"])
    assert [tuple(e) for e in spec.layout.engines] == [(4, 5, 6, 7)]  # one engine, TP 4, after the actor's 4
    groups = {r: SimpleNamespace(workers=[_Handle(f"{r}{i}") for i in range(len(spec.layout.roles.get(r, ())) or 1)])
              for r in spec.roles}
    groups["rollout"] = SimpleNamespace(workers=[_Handle(f"rollout{i}") for i in range(len(spec.layout.engines))])
    if role == "rollout":  # the vLLM engine spanning GPUs 4-7
        who = "rollout engine 0 (GPUs 4-7)"
        rank = 0
    else:  # the actor's last rank
        rank = len(spec.layout.roles["actor"]) - 1
        who = f"actor rank {rank} (GPU {spec.layout.roles['actor'][rank]})"
    cluster = SimpleNamespace(groups=groups, spec=spec, nodes=[])
    e = RayActorError(actor_id=f"{role}{rank}")
    line = worker_failure(e, cluster)
    assert "\n" not in line
    assert line.startswith(f"{who} died during the run: "), line
    assert "Cluster shut down." in line


def test_engines_sharing_a_gpu_are_named_by_engine_with_their_one_gpu(tmp_path):
    """Two engines on GPU 1 (placement.rollout.engines_per_device=2): the second's death names it and
    its GPU; the engines' group, as a collective timeout line names it, lists GPU 1 once."""
    from ray.exceptions import RayActorError

    from rlhf.launch.failures import _group, worker_failure

    spec = planned_spec(["model=qwen2.5-0.5b", "hardware=2xh200", "placement=disaggregated", "algo.kl.coef=0",
                         "placement.rollout.engines_per_device=2", f"output_dir={tmp_path}", "model.path=/nonexistent"])
    assert spec.layout.engines == ((1,), (1,))
    groups = {"actor": SimpleNamespace(workers=[_Handle("actor0")]),
              "rollout": SimpleNamespace(workers=[_Handle("rollout0"), _Handle("rollout1")])}
    cluster = SimpleNamespace(groups=groups, spec=spec, nodes=[])
    line = worker_failure(RayActorError(actor_id="rollout1"), cluster)
    assert line.startswith("rollout engine 1 (GPU 1) died during the run: "), line
    assert _group(cluster, "rollout") == "rollout engines 0-1 (GPU 1)"
