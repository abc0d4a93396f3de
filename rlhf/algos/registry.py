"""The algorithm parts by name: advantage estimators, policy losses and KL estimators.

A part is a function registered under a name with a decorator; ``conf/algo/<name>.yaml`` chooses
it (``algo.estimator``, ``algo.policy_loss``, ``algo.kl.estimator``) and the objective
(``rlhf.algos.objective``) looks it up instead of branching on names:

    @register_advantage_estimator("centred", grouped=True)      # in a module named in algo.plugins
    def centred(x: AdvantageInputs) -> tuple[Tensor, Optional[Tensor]]: ...

    @register_policy_loss("vanilla")
    def vanilla(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]: ...

A second registration under a name is an error, so a plugin cannot replace a built-in by accident.

This module imports no torch: the spec's validator reads the names and the estimators' metadata
(``EstimatorInfo``: needs a critic, compares samples of a prompt, whitened by default) from here,
and ``--plan`` runs without torch. So the built-ins are *declared* below, with their metadata, and
``advantages.py``, ``losses.py`` and ``kl.py`` attach their functions with the same decorators
(without metadata); ``get`` imports those modules the first time a function is needed. A part
from outside rlhf gives its metadata in its decorator and lives in a module named in
``algo.plugins``, which ``load_plugins`` imports in every process that looks parts up (the
driver's validation and loop, the training workers).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

from rlhf.plugins import import_problem

__all__ = [
    "EstimatorInfo",
    "PartInfo",
    "Registry",
    "RegistryError",
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "DISTILL_DIVERGENCES",
    "PREFERENCE_LOSSES",
    "REFERENCE_FREE_LOSSES",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_kl_estimator",
    "load_plugins",
    "plugin_problem",
]


class RegistryError(ValueError):
    """An unknown name, or a name registered twice."""


@dataclass(frozen=True)
class PartInfo:
    """What the spec knows of a policy loss or KL estimator: its name is all it checks."""


@dataclass(frozen=True)
class EstimatorInfo:
    """What the spec's validator and build read of an advantage estimator."""

    needs_critic: bool = False  # uses a critic's values (GAE): the run gets a critic role
    grouped: bool = False  # compares the samples of one prompt: needs algo.group_size >= 2
    whiten: bool = False  # its advantages are whitened over the batch (PPO practice for GAE)


Info = TypeVar("Info", EstimatorInfo, PartInfo)


class Registry(Generic[Info]):
    """Names → functions and metadata of one kind of part.

    ``builtins`` declares the parts rlhf ships (name → metadata) without importing their module
    ``home``; their functions attach when ``home`` is imported."""

    def __init__(self, kind: str, key: str, home: str, builtins: dict[str, Info], info_type: type):
        self.kind, self.key, self.home = kind, key, home
        self._info: dict[str, Info] = dict(builtins)
        self._builtins = frozenset(builtins)
        self._fn: dict[str, Callable] = {}
        self._info_type = info_type

    def register(self, name: str, **metadata: Any) -> Callable[[Callable], Callable]:
        """Decorator: register ``fn`` under ``name``. A built-in takes its metadata from the
        declaration above; any other part gives it here (``grouped=True``, ...)."""

        def deco(fn: Callable) -> Callable:
            if name in self._fn:
                raise RegistryError(f"{self.kind} {name!r} is registered twice: by {_where(self._fn[name])} "
                                    f"and by {_where(fn)}. Choose another name.")
            if name in self._builtins:
                if metadata:
                    raise RegistryError(f"{self.kind} {name!r} is declared in {__name__}; give its metadata "
                                        "there, not in the decorator.")
            else:
                self._info[name] = self._info_type(**metadata)
            self._fn[name] = fn
            return fn

        return deco

    def names(self) -> tuple[str, ...]:
        """Every name known in this process: the built-ins and the plugins imported so far."""
        return tuple(self._info)

    def builtin_names(self) -> tuple[str, ...]:
        """The parts rlhf ships, in declaration order."""
        return tuple(n for n in self._info if n in self._builtins)

    def info(self, name: str) -> Info:
        if name not in self._info:
            raise RegistryError(self.unknown(name))
        return self._info[name]

    def get(self, name: str) -> Callable:
        """The function registered under ``name`` (importing the built-ins' module if needed)."""
        self.info(name)
        if name not in self._fn and name in self._builtins:
            importlib.import_module(self.home)
        if name not in self._fn:
            raise RegistryError(f"{self.kind} {name!r} is declared but no function is registered for it "
                                f"in {self.home}.")
        return self._fn[name]

    def unknown(self, name: str) -> str:
        return (f"{self.key}={name!r} is not valid. Choose one of: {', '.join(self.names())} (or register "
                f"another {self.kind} in a module named in algo.plugins).")


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------------- built-ins

ADVANTAGE_ESTIMATORS: Registry[EstimatorInfo] = Registry(
    "advantage estimator", "algo.estimator", "rlhf.algos.advantages", {
        "gae": EstimatorInfo(needs_critic=True, whiten=True),
        "grpo": EstimatorInfo(grouped=True),
        "dr_grpo": EstimatorInfo(grouped=True),
        "rloo": EstimatorInfo(grouped=True),
        "reinforce_pp": EstimatorInfo(),
        "reinforce_pp_baseline": EstimatorInfo(grouped=True),
        "distill": EstimatorInfo(),  # on-policy distillation (rlhf.algos.distill, attached via advantages)
    }, EstimatorInfo)

POLICY_LOSSES: Registry[PartInfo] = Registry(
    "policy loss", "algo.policy_loss", "rlhf.algos.losses",
    {name: PartInfo() for name in ("clip", "cispo", "sapo")}, PartInfo)

KL_ESTIMATORS: Registry[PartInfo] = Registry(
    "KL estimator", "algo.kl.estimator", "rlhf.algos.kl", {k: PartInfo() for k in ("k1", "k2", "k3")}, PartInfo)

# the preference trainer's methods (algo.loss_type of algo=dpo|kto|orpo|simpo; rlhf.algos.preference), and
# those that need no reference model; fixed, not a registry
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "kto", "orpo", "simpo")
REFERENCE_FREE_LOSSES = ("orpo", "simpo")

# on-policy distillation's per-token divergences from the teacher (algo.teacher.divergence;
# rlhf.algos.distill); fixed, not a registry
DISTILL_DIVERGENCES = ("reverse_kl", "jsd")

# how per-token losses reduce to one number (rlhf.algos.losses.aggregate); fixed, not a registry
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")

register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
register_kl_estimator = KL_ESTIMATORS.register


def load_plugins(modules: Sequence[str]) -> None:
    """Import the modules named in ``algo.plugins`` (their decorators register parts). Importing
    one twice is a no-op (Python caches modules), so every caller may call this."""
    for name in modules:
        importlib.import_module(name)


def plugin_problem(name: str) -> Optional[str]:
    """None if module ``name`` imports, else one line naming it, the error and the fix."""
    return import_problem("algo.plugins", name)
