"""A toy advantage estimator and a toy policy loss, registered from outside rlhf (``algo.plugins``):
what a user writes to try an algorithm part without editing the package."""

from __future__ import annotations

import torch

from rlhf.algos import AdvantageInputs, PolicyLossInputs, broadcast_to_tokens
from rlhf.algos.registry import register_advantage_estimator, register_policy_loss

CALLS = {"sign": 0}  # estimator calls in this process (the driver runs the estimator)


@register_advantage_estimator("sign", grouped=True)
def sign_advantages(x: AdvantageInputs):
    """+1 for a sample scoring above its group's mean, -1 below, 0 at the mean."""
    CALLS["sign"] += 1
    s = x.scores.double().view(-1, x.group_size)
    seq = torch.sign(s - s.mean(dim=1, keepdim=True)).reshape(-1)
    return broadcast_to_tokens(seq, x.mask), None


@register_policy_loss("reinforce")
def reinforce_loss(x: PolicyLossInputs):
    """Plain REINFORCE, ``-A_t * logp_t`` (no ratio, no clipping): the gradient of the clipped
    surrogate at ratio 1, so right for one on-policy optimizer step per batch."""
    keep = x.mask != 0
    loss = torch.where(keep, -x.advantages.to(x.logp.dtype) * x.logp, torch.zeros_like(x.logp))
    return loss, {"reinforce_logp_mean": (x.logp.detach() * keep).sum() / keep.sum().clamp(min=1)}
