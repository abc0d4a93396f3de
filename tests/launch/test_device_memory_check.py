"""The start-up check of ``hardware.device_memory_gb`` against the GPU's total as CUDA reports it
(rlhf.plan.memory.device_memory_mismatch and device_memory_refusal, asked of one worker by
rlhf.launch.cluster): one warning line per run when they differ by more than 3 %, naming both
numbers and the fix; an error, and the cluster shut down, when the GPU is smaller and the plan does
not fit it. Beside it, the start-up order on a GPU that vLLM shares with the models: the engines
start once the models have loaded. CUDA's total and the Ray actors are stood in for (CPU machine)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from rlhf.launch import cluster as launch_cluster
from rlhf.launch import group as launch_group
from rlhf.launch.group import ActorGroup
from rlhf.plan.memory import device_memory_mismatch, device_memory_refusal, estimate, over_limit
from rlhf.spec.errors import UserError
from rlhf.workers.policy import PolicyWorker

from tests.helpers import planned_spec

MIB, GIB = 2**20, 2**30
H200_TOTAL = 143_771 * MIB  # torch.cuda.mem_get_info()[1] on an H200 (150,754,820,096 bytes)


def test_the_shipped_files_agree_with_the_cuda_totals():
    assert device_memory_mismatch(planned_spec(["hardware=1xh200"]), H200_TOTAL) is None
    assert device_memory_mismatch(planned_spec(["hardware=2xh200"]), H200_TOTAL) is None
    # H100 80GB HBM3 and A100 80GB: 79.1 and 79.35 GiB in torch, both within 3 % of 84.9 GB
    for hw in ("1xh100", "8xh100", "8xa100-80g", "4x8xh100"):
        for gib in (79.1, 79.35):
            assert device_memory_mismatch(planned_spec([f"hardware={hw}"]), int(gib * GIB)) is None, (hw, gib)


def test_a_file_in_gib_gets_one_line_with_both_numbers_and_the_fix():
    spec = planned_spec(["hardware=1xh200", "hardware.device_memory_gb=141"])
    line = device_memory_mismatch(spec, H200_TOTAL)
    assert line is not None and "\n" not in line
    assert line.startswith("hardware.device_memory_gb=141 but this GPU's total is 150.75 GB (140.4 GiB")
    assert line.endswith("set hardware.device_memory_gb=150.7.")  # rounded down, as the shipped files are


def test_the_tolerance_is_3_percent_either_way():
    from rlhf.plan.memory import DEVICE_MEMORY_TOLERANCE

    assert "| 0.03 | `DEVICE_MEMORY_TOLERANCE` |" in (Path(__file__).parents[2] / "docs" / "memory.md").read_text()
    assert DEVICE_MEMORY_TOLERANCE == 0.03
    spec = planned_spec(["hardware=1xh200", "hardware.device_memory_gb=100"])
    for gb, warns in ((102.9, False), (97.1, False), (103.1, True), (96.9, True)):
        assert (device_memory_mismatch(spec, int(gb * 1e9)) is not None) == warns, gb


def test_the_worker_reads_cudas_total(monkeypatch):
    monkeypatch.setattr(torch, "cuda", NS(mem_get_info=lambda: (100 * GIB, H200_TOTAL)))
    w = object.__new__(PolicyWorker)  # no __init__: only the attribute the method reads
    w.device = "cuda"
    assert w.device_memory_total() == H200_TOTAL
    w.device = "cpu"
    assert w.device_memory_total() == 0


class _Rank:
    """A rank that answers ``h.method.remote()`` itself and counts the totals it was asked for."""

    def __init__(self, asked: list, role: str, rank: int, total: int):
        self.asked, self.role, self.rank, self.total = asked, role, rank, total

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        answers = {"address": ("10.0.0.1", 29500), "init_distributed": None, "device_memory_total": self.total,
                   "prepare": None}
        return NS(remote=lambda *a, **kw: (name == "device_memory_total" and self.asked.append((self.role, self.rank)),
                                           answers[name])[1])


@pytest.mark.parametrize("stated, warns", [(141, True), (150.7, False)])
def test_start_cluster_asks_one_worker_once(monkeypatch, stated, warns):
    """Every rank of every role starts; the total is asked of the first model worker's rank 0 only
    (not of a vLLM engine, whose process may hold no GPU), and at most one line comes back."""
    spec = planned_spec(["hardware=2xh200", f"hardware.device_memory_gb={stated}",
                         "placement.rollout.engines_per_device=1"])  # the two ranks per role placed below
    asked: list = []

    def place(spec, cluster):
        for role in ("rollout", "reference", "actor"):  # the actor is asked first whatever the order
            cluster.groups[role] = ActorGroup(role, [_Rank(asked, role, r, H200_TOTAL) for r in range(2)])

    monkeypatch.setattr(launch_cluster, "init_ray", lambda spec: False)
    monkeypatch.setattr(launch_cluster, "_place", place)
    for module in (launch_cluster, launch_group):
        monkeypatch.setattr(module.ray, "get", lambda refs: refs)
    cluster = launch_cluster.start_cluster(spec)
    assert asked == [("actor", 0)]
    assert len(cluster.warnings) == int(warns)
    if warns:
        assert f"hardware.device_memory_gb={stated:g} but this GPU's total is 150.75 GB" in cluster.warnings[0]


def test_no_check_off_cuda():
    spec = planned_spec([])
    assert spec.device == "cpu"
    assert launch_cluster.check_device_memory(spec, launch_cluster.Cluster(spec=spec)) is None


H100_TOTAL = int(79.18 * GIB)  # an H100 80GB HBM3 as CUDA reports it (torch's OOM line: 79.18 GiB): 85.02 GB
# issue 33's 1.5B peer workload from the 1xh200 recipe (M = 150.7), as the twenty-sixth session ran it on an H100
P1 = ["hardware=1xh200", "model=qwen2.5-1.5b", "train.prompts_per_step=32", "train.micro_batch_size=16",
      "algo.group_size=8", "rollout.max_prompt_tokens=128", "rollout.max_response_tokens=256",
      "rollout.gpu_memory_utilization=0.5", "placement.sleep_rollout=true", "model.liger_kernels=false",
      "algo.kl.coef=0"]


def test_a_smaller_gpu_the_plan_does_not_fit_is_refused_with_the_figure_and_the_fix():
    spec = planned_spec(P1)
    assert spec.hardware.device_memory_gb == 150.7 and spec.train.max_tokens_per_micro_batch == 16384
    line = device_memory_refusal(spec, H100_TOTAL)
    assert line is not None and "\n" not in line
    assert line.startswith("hardware.device_memory_gb=150.7 but this GPU's total is 85.02 GB (79.2 GiB")
    assert line.endswith("set hardware.device_memory_gb=85 and the plan chooses for this GPU (--plan shows it).")
    # the figure named is the plan's own choices estimated at 85 GB, written out here as overrides
    chosen = [f"{d.key}={str(d.value).lower() if isinstance(d.value, bool) else d.value}" for d in spec.auto]
    assert "placement.offload_train_state=false" in chosen  # resident: what the larger GPU allowed
    same_choices = planned_spec(P1 + [f"hardware.device_memory_gb={H100_TOTAL / 1e9}"] + chosen)
    est = estimate(same_choices)
    over = over_limit(same_choices, est)
    assert list(over) == ["training phase"] and over["training phase"] > 0.95 * H100_TOTAL / 1e9
    assert f"training phase {est.total('training phase'):.1f} GB" in line
    # with the fix the plan picks for the GPU (a smaller token budget) and the check passes
    fixed = planned_spec(P1 + ["hardware.device_memory_gb=85"])
    assert fixed.train.max_tokens_per_micro_batch == 8192
    assert device_memory_refusal(fixed, H100_TOTAL) is None and device_memory_mismatch(fixed, H100_TOTAL) is None


def test_a_smaller_gpu_the_plan_still_fits_and_a_larger_one_are_only_warned(monkeypatch):
    small = planned_spec(["hardware=1xh200", "model=qwen2.5-0.5b", "train.max_tokens_per_micro_batch=4096",
                          "rollout.gpu_memory_utilization=0.3"])
    assert device_memory_refusal(small, H100_TOTAL) is None
    assert device_memory_mismatch(small, H100_TOTAL) is not None
    stated_less = planned_spec(P1 + ["hardware.device_memory_gb=85"])  # an H200 under a file that says less
    assert device_memory_refusal(stated_less, H200_TOTAL) is None
    assert device_memory_mismatch(stated_less, H200_TOTAL) is not None
    # within the tolerance nothing is estimated again: 3 % below the stated figure is the same GPU
    from rlhf.plan import memory

    spec, planned = planned_spec(P1), []
    monkeypatch.setattr(memory, "estimate", lambda s: planned.append(s.hardware.device_memory_gb) or estimate(s))
    assert device_memory_refusal(spec, int(150.7 * 0.971 * 1e9)) is None and planned == []
    assert device_memory_refusal(spec, int(150.7 * 0.969 * 1e9)) is None  # estimated at 146.0 GB: it fits
    assert planned == [pytest.approx(150.7 * 0.969)]


def test_start_cluster_refuses_a_smaller_gpu_before_any_model_loads_and_shuts_the_cluster_down(monkeypatch):
    spec = planned_spec(P1)
    shut: list = []
    started: list = []

    class Rank(_Rank):
        def __getattr__(self, name):
            if name in ("address", "init_distributed"):
                started.append(name)
            return super().__getattr__(name)

    def place(spec, cluster):
        cluster.groups["actor"] = ActorGroup("actor", [Rank([], "actor", 0, H100_TOTAL)])

    monkeypatch.setattr(launch_cluster, "init_ray", lambda spec: False)
    monkeypatch.setattr(launch_cluster, "_place", place)
    monkeypatch.setattr(launch_cluster.Cluster, "shutdown", lambda self: shut.append(True))
    for module in (launch_cluster, launch_group):
        monkeypatch.setattr(module.ray, "get", lambda refs: refs)
    with pytest.raises(UserError, match=r"^hardware.device_memory_gb=150.7 but .* set hardware.device_memory_gb=85 "):
        launch_cluster.start_cluster(spec)
    assert shut == [True] and started == []


@pytest.mark.parametrize("engine, waits", [("vllm", True), ("hf", False)])
def test_vllm_engines_beside_the_models_start_once_the_models_have_loaded(monkeypatch, engine, waits):
    """vLLM sizes its KV cache from the GPU's free memory while it starts and stops when that grows
    under it: in hybrid placement its engines start after the model workers' ``init_distributed``
    (load + release of set-up's cache) has returned. An engine that sizes nothing from the free
    memory (HF) starts beside them. Either way each rollout worker's ``prepare`` (vLLM's imports,
    no device) is asked for before the models start, and waited for with them."""
    spec = planned_spec(["hardware=1xh200", f"rollout.engine={engine}", "placement.rollout.engines_per_device=1"])
    assert spec.layout.one_pool and launch_cluster.engines_wait_for_models(spec) == waits
    events: list = []

    class Rank(_Rank):
        def __getattr__(self, name):
            if name == "init_distributed":
                return NS(remote=lambda *a: (events.append(("start", self.role)), ("ref", self.role))[1])
            if name == "prepare":
                return NS(remote=lambda *a: (events.append(("prepare", self.role)), ("ref", "prepared"))[1])
            return super().__getattr__(name)

    def place(spec, cluster):
        for role in ("rollout", "reference", "actor"):
            cluster.groups[role] = ActorGroup(role, [Rank([], role, 0, H200_TOTAL)])

    def get(refs):
        if isinstance(refs, list) and refs and isinstance(refs[0], tuple) and refs[0][0] == "ref":
            events.append(("wait", tuple(sorted(r[1] for r in refs))))
        return refs

    monkeypatch.setattr(launch_cluster, "init_ray", lambda spec: False)
    monkeypatch.setattr(launch_cluster, "_place", place)
    for module in (launch_cluster, launch_group):
        monkeypatch.setattr(module.ray, "get", get)
    launch_cluster.start_cluster(spec)
    assert events[0] == ("prepare", "rollout")  # the imports beside the models' loading
    rollout_at = events.index(("start", "rollout"))
    models_waited = ("wait", ("actor", "prepared", "reference")) in events[:rollout_at]
    assert models_waited == waits, events
    assert {("start", "actor"), ("start", "reference")} <= set(events[:rollout_at])  # models first either way
    assert events[-1] == ("wait", ("actor", "prepared", "reference", "rollout"))  # every call waited for at the end
    cluster = launch_cluster.start_cluster(spec)  # the console's "cluster up" line names the phases timed
    phases = ["Ray", "models", "engines"] if waits else ["Ray", "models + engines"]
    assert list(cluster.start_seconds) == phases and all(v >= 0 for v in cluster.start_seconds.values())
    cluster.start_seconds.update({p: 1.25 * (i + 1) for i, p in enumerate(phases)})
    assert launch_cluster.start_phases(cluster) == ", ".join(f"{p} {1.25 * (i + 1):.1f} s" for i, p in enumerate(phases))


def test_disaggregated_engines_start_beside_the_models():
    spec = planned_spec(["hardware=8xh100", "placement=disaggregated"])
    assert launch_cluster.engines.kind(spec).starts_alone_on_device  # vLLM on GPU
    assert not launch_cluster.engines_wait_for_models(spec)
