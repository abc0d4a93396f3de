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
