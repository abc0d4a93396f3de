"""The frozen run spec's type: ``RunSpec`` (what ``rlhf.spec.build`` returns and every layer receives)
and the derived parts it holds. Only types here, so that any module can annotate a ``spec`` without
importing the build (and what the build imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf.spec import schema as S
from rlhf.placement.layout import Layout

ROLES = ("actor", "critic", "reference", "teacher", "reward", "rollout")


@dataclass
class Decision(S.Frozen):
    """A value the build chose: ``key`` (dotted config key) was ``given`` (auto / None) and is ``value``."""

    key: str
    given: Any
    value: Any
    why: str  # one short line for the plan; "" when there is nothing worth saying


@dataclass
class BatchPlan(S.Frozen):
    """The batch math of one step, computed once (all counts are samples, not tokens)."""

    prompts_per_step: int
    group_size: int
    samples_per_step: int
    train_world_size: int  # data-parallel ranks of the actor
    mini_batch_size: int  # samples per optimizer step, all ranks together
    optimizer_steps_per_step: int  # per rollout batch, all epochs
    micro_batch_size: int  # samples per forward/backward on one rank
    grad_accum: int  # micro-batches per rank per optimizer step


@dataclass
class ResolvedModel(S.Frozen):
    """Where a model of the run was found by the driver's preflight (``rlhf.models.resolve_model``)."""

    path: str  # the local checkpoint dir (a Hub id's snapshot in the HF cache)
    repo: Optional[str] = None  # the Hub repo, when it came from one
    commit: Optional[str] = None  # ... and its commit: another node fetches exactly this one


@dataclass
class RunSpec(S.Frozen):
    """The run: the config's sections typed and validated, what the build derived from them, frozen."""

    algo: S.AlgoSpec
    model: S.ModelSpec
    hardware: S.HardwareSpec
    placement: S.PlacementSpec
    rollout: S.RolloutSpec
    train: S.TrainSpec
    data: S.DataSpec
    reward: S.RewardSpec
    tracking: S.TrackingSpec
    checkpoint: S.CheckpointSpec
    ray: S.RaySpec
    eval: S.EvalSpec
    env: S.EnvSpec
    agent: S.AgentSpec
    mode: str
    output_dir: Optional[str]
    resume: Optional[str]
    roles: tuple[str, ...]  # the roles this run needs, in ROLES order
    batch: BatchPlan
    layout: Layout
    rollout_engine: str  # resolved: hf | vllm
    overrides: tuple[str, ...] = field(default_factory=tuple)  # the command line's overrides
    changes: tuple[str, ...] = field(default_factory=tuple)  # what differs from the defaults (for the plan)
    auto: tuple[Decision, ...] = field(default_factory=tuple)  # values the build chose (rlhf.plan.auto)
    # "model" / "reward" -> where preflight found model.path / reward.model_path (``with_models``)
    models: dict[str, ResolvedModel] = field(default_factory=dict)
    # a plan without output_dir: the run dir a run would get (hydra.run.dir, made unique; not created)
    planned_run_dir: Optional[str] = None

    @property
    def device(self) -> str:
        return "cuda" if self.hardware.accelerator == "cuda" else "cpu"

    @property
    def run_dir(self) -> str:
        """Where the run writes: ``output_dir`` (the CLI always sets it for a run), else the run dir
        a plan's run would get (``planned_run_dir``), else ``outputs/run`` for a spec built another way."""
        return self.output_dir or self.planned_run_dir or "outputs/run"
