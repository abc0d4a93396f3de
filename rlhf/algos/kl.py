"""KL penalty estimators, KL coefficient controllers, and how far the rollout engine's sampled-token
log-probs are from the trainer's (``logprob_mismatch``: any engine, measured in the trainer)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

import torch

from rlhf.algos.registry import KL_ESTIMATORS, register_kl_estimator

__all__ = ["kl_penalty", "FixedKLController", "AdaptiveKLController", "mismatch_sums", "logprob_mismatch"]


@register_kl_estimator("k1")
def k1(log_ratio: torch.Tensor, clamp: Optional[float]) -> torch.Tensor:
    """``x``: unbiased, high variance, can be negative."""
    return log_ratio


@register_kl_estimator("k2")
def k2(log_ratio: torch.Tensor, clamp: Optional[float]) -> torch.Tensor:
    """``0.5 * x^2``: biased, low variance, >= 0."""
    return 0.5 * log_ratio * log_ratio


@register_kl_estimator("k3")
def k3(log_ratio: torch.Tensor, clamp: Optional[float]) -> torch.Tensor:
    """``exp(-x) - 1 + x``: unbiased, low variance, >= 0; ``x`` clamped to ``[-clamp, clamp]`` first
    so that the value and its gradient stay finite."""
    xc = log_ratio.clamp(-clamp, clamp) if clamp is not None else log_ratio
    return torch.exp(-xc) - 1.0 + xc


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: Union[str, Callable[[torch.Tensor, Optional[float]], torch.Tensor]] = "k1",
    clamp: Optional[float] = 10.0,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    From J. Schulman, "Approximating KL Divergence" (2020). With
    ``x = log_ratio = logp - ref_logp`` (i.e. ``r = pi_ref / pi = exp(-x)``), ``estimator`` names
    a KL estimator of ``rlhf.algos.registry`` (or is the registered function, looked up once by
    ``rlhf.algos.objective.Objective``); the built-ins::

        k1 = x                       (unbiased, high variance, can be negative)
        k2 = 0.5 * x^2               (biased, low variance, >= 0)
        k3 = exp(-x) - 1 + x         (= (r - 1) - log r: unbiased, low variance, >= 0)

    If ``clamp`` is not None the estimate is clamped to ``[-clamp, clamp]``; for k3
    the log-ratio is also clamped to ``[-clamp, clamp]`` before exponentiation so the
    value and its gradient stay finite. If ``mask`` is given the result is 0 where
    ``mask == 0`` (values there are ignored even if non-finite). Shape of the
    inputs (e.g. ``[B, T]``) is kept. Differentiable w.r.t. ``logp``.
    """
    # a name: RegistryError (a ValueError) when unknown
    fn = KL_ESTIMATORS.get(estimator) if isinstance(estimator, str) else estimator
    x = logp - ref_logp
    if mask is not None:
        x = torch.where(mask != 0, x, torch.zeros_like(x))
    kl = fn(x, clamp)
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    if mask is not None:
        kl = kl * mask.to(kl.dtype)
    return kl


class FixedKLController:
    """Constant KL coefficient ``beta``; ``update`` does nothing."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: Any = None, n_steps: int = 1) -> float:
        """No-op; returns the (constant) coefficient."""
        return self.value

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models
    from Human Preferences", sec. 2.2)::

        e_t       = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta_{t+1} = beta_t * (1 + K_beta * e_t),   K_beta = n_steps / horizon

    ``current_kl`` is the measured KL (float or scalar tensor), ``n_steps`` the number
    of samples (or steps) since the last update.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be positive")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: Any, n_steps: int) -> float:
        """Apply one update; returns the new coefficient."""
        kl = float(current_kl.item() if isinstance(current_kl, torch.Tensor) else current_kl)
        err = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value = self.value * (1.0 + n_steps / self.horizon * err)
        return self.value

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


# ----------------------------------------------------------------------------- rollout vs trainer


def mismatch_sums(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The sums behind ``logprob_mismatch`` over the policy tokens, as float64 tensors on the inputs'
    device (added up over micro-batches without reading them back): ``n`` tokens, ``abs`` = Σ|d|,
    ``k3`` = Σ(exp(d) - 1 - d), ``max`` = max|d|, with d = trainer − rollout log-prob."""
    keep = mask != 0
    d = (trainer_logp.double() - rollout_logp.double()) * keep
    return {"n": keep.sum().double(), "abs": d.abs().sum(), "k3": ((torch.exp(d.clamp(-20, 20)) - 1 - d) * keep).sum(),
            "max": d.abs().max() if d.numel() else d.new_zeros(())}


def logprob_mismatch(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """How far the rollout engine's sampled-token logprobs are from the trainer's recomputation
    over policy tokens: mean and max absolute difference, and the k3 estimate of KL(rollout||trainer)
    (Schulman 2020, "Approximating KL divergence"; the tokens were sampled by the rollout engine)."""
    s = mismatch_sums(rollout_logp, trainer_logp, mask)
    n = float(s["n"])
    if n == 0:
        return {"mismatch/logp_abs_mean": 0.0, "mismatch/logp_abs_max": 0.0, "mismatch/kl_k3": 0.0}
    return {"mismatch/logp_abs_mean": float(s["abs"]) / n, "mismatch/logp_abs_max": float(s["max"]),
            "mismatch/kl_k3": float(s["k3"]) / n}
