"""KL penalty estimators and KL coefficient controllers."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["KL_ESTIMATORS", "kl_penalty", "FixedKLController", "AdaptiveKLController"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k1",
    clamp: Optional[float] = 10.0,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    From J. Schulman, "Approximating KL Divergence" (2020). With
    ``x = log_ratio = logp - ref_logp`` (i.e. ``r = pi_ref / pi = exp(-x)``)::

        k1 = x                       (unbiased, high variance, can be negative)
        k2 = 0.5 * x^2               (biased, low variance, >= 0)
        k3 = exp(-x) - 1 + x         (= (r - 1) - log r: unbiased, low variance, >= 0)

    If ``clamp`` is not None the estimate is clamped to ``[-clamp, clamp]``; for k3
    the log-ratio is also clamped to ``[-clamp, clamp]`` before exponentiation so the
    value and its gradient stay finite. If ``mask`` is given the result is 0 where
    ``mask == 0`` (values there are ignored even if non-finite). Shape of the
    inputs (e.g. ``[B, T]``) is kept. Differentiable w.r.t. ``logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    x = logp - ref_logp
    if mask is not None:
        x = torch.where(mask != 0, x, torch.zeros_like(x))
    if estimator == "k1":
        kl = x
    elif estimator == "k2":
        kl = 0.5 * x * x
    else:
        xc = x.clamp(-clamp, clamp) if clamp is not None else x
        kl = torch.exp(-xc) - 1.0 + xc
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
