"""Policy-gradient losses, value loss, log-probabilities and loss aggregation.

Conventions: token tensors ``[B, T]`` with ``mask [B, T]`` (1 = policy token that
counts in the loss, 0 = padding or tool/environment token). All per-token losses
returned here are 0 at masked positions and are meant to be reduced with
:func:`aggregate` / :func:`micro_batch_loss`.

Aggregation design
------------------
A loss is ``sum over samples of a per-sample numerator`` divided by one
``denominator`` computed ONCE for the whole global batch (every micro-batch on
every data-parallel rank):

============================  ===============================================  ===========================
mode                          per-sample numerator                             denominator
============================  ===============================================  ===========================
``token_mean``                ``sum_t l_t``                                    number of policy tokens
``seq_mean_token_sum``        ``sum_t l_t``                                    number of sequences
``seq_mean_token_mean``       ``sum_t l_t / n_i`` (``n_i`` tokens of row i)    number of sequences
``seq_mean_token_sum_norm``   ``sum_t l_t``                                    number of sequences * L
============================  ===============================================  ===========================

("number of sequences" counts rows with at least one policy token; ``L`` is the
constant maximum response length of Dr. GRPO, Liu et al. 2025.)

Because the numerator is a sum over samples and the denominator is fixed, the
micro-batch losses ``sum(numerators in micro-batch) / denominator`` add up exactly
to the whole-batch loss, so gradient accumulation (summing gradients of
micro-batches) reproduces the whole-batch gradient. Denominators are additive over
disjoint shards: on each rank compute :func:`aggregation_denominator` on the
rank's mini-batch and all-reduce (SUM) it. Data-parallel engines (DDP, DeepSpeed)
*average* gradients over ranks, so each rank's loss is multiplied by the world
size (:func:`micro_batch_loss`) to recover the gradient of the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from rlhf.algos.advantages import masked_mean
from rlhf.algos.registry import LOSS_AGGREGATIONS, register_policy_loss

__all__ = [
    "token_logprobs",
    "entropy_from_logits",
    "policy_loss",
    "PolicyLossInputs",
    "clipped_policy_loss",
    "cispo_policy_loss",
    "sapo_policy_loss",
    "value_loss",
    "aggregation_denominator",
    "aggregate",
    "micro_batch_loss",
]

# number of (position x vocab) logits processed at once by the chunked kernels
_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(n_rows: int, vocab: int) -> int:
    return max(1, min(n_rows, _CHUNK_ELEMENTS // max(vocab, 1)))


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / tau)[token], chunked; backward without [N, V] temporaries
    other than the gradient itself."""

    @staticmethod
    def forward(ctx, logits2d: torch.Tensor, tokens1d: torch.Tensor, temperature: float):  # type: ignore[override]
        N, V = logits2d.shape
        out_dtype = torch.promote_types(logits2d.dtype, torch.float32)
        out = torch.empty(N, dtype=out_dtype, device=logits2d.device)
        lse_all = torch.empty(N, dtype=out_dtype, device=logits2d.device)
        step = _chunk_rows(N, V)
        for s in range(0, N, step):
            chunk = logits2d[s : s + step].to(out_dtype)
            if temperature != 1.0:
                chunk = chunk / temperature
            lse = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, tokens1d[s : s + step].unsqueeze(1)).squeeze(1)
            out[s : s + step] = picked - lse
            lse_all[s : s + step] = lse
        ctx.save_for_backward(logits2d, tokens1d, lse_all)
        ctx.temperature = temperature
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits2d, tokens1d, lse_all = ctx.saved_tensors
        tau = ctx.temperature
        N, V = logits2d.shape
        grad = torch.empty_like(logits2d)
        step = _chunk_rows(N, V)
        for s in range(0, N, step):
            chunk = logits2d[s : s + step].to(lse_all.dtype)
            if tau != 1.0:
                chunk = chunk / tau
            g = grad_out[s : s + step].to(lse_all.dtype).unsqueeze(1)
            # d/dl_v [l_y/tau - lse(l/tau)] = (1[v == y] - softmax_v) / tau
            gc = torch.exp(chunk - lse_all[s : s + step].unsqueeze(1)).mul_(-g)
            gc.scatter_add_(1, tokens1d[s : s + step].unsqueeze(1), g)
            if tau != 1.0:
                gc.div_(tau)
            grad[s : s + step] = gc.to(grad.dtype)
        return grad, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token: ``log softmax(logits[b, t] / temperature)[tokens[b, t]]``.

    ``logits [B, T, V]`` and ``tokens [B, T]`` are aligned (``logits[:, t]`` scores
    ``tokens[:, t]``; do the next-token shift before calling). Computed as
    ``l_y / tau - logsumexp(l / tau)`` in chunks of positions, in float32 or wider
    (bf16/fp16 logits are upcast chunk by chunk), with a custom backward
    ``dL/dl_v = g * (1[v=y] - p_v) / tau`` so no full-size ``[B, T, V]`` float32
    copy or softmax is kept for autograd. Returns ``[B, T]`` (float32 or float64).
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError("logits must be [B, T, V] and tokens [B, T]")
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    B, T, V = logits.shape
    out = _TokenLogProbs.apply(logits.reshape(B * T, V), tokens.reshape(B * T).long(), float(temperature))
    return out.view(B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at every position.

    ``H = -sum_v p_v log p_v = logsumexp(l) - sum_v p_v l_v`` with ``p = softmax(l)``,
    computed in float32 or wider, in chunks of positions. ``logits [..., V]`` ->
    ``[...]`` (e.g. ``[B, T, V] -> [B, T]``). Differentiable.
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    dt = torch.promote_types(logits.dtype, torch.float32)
    step = _chunk_rows(flat.shape[0], V)
    parts = []
    for s in range(0, flat.shape[0], step):
        c = flat[s : s + step].to(dt)
        lse = torch.logsumexp(c, dim=-1)
        p = torch.softmax(c, dim=-1)
        parts.append(lse - (p * c).sum(dim=-1))
    if not parts:
        return torch.zeros(logits.shape[:-1], dtype=dt, device=logits.device)
    return torch.cat(parts).view(logits.shape[:-1])


_LOG_RATIO_LIMIT = 20.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    ratio_level: str = "token",
    rollout_logp: Optional[torch.Tensor] = None,
    tis_cap: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss, per token.

    With ``rho_t`` the importance ratio and ``A_t`` the advantage (PPO, Schulman et
    al. 2017, with the asymmetric "clip-higher" range of DAPO, Yu et al. 2025)::

        l_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - clip_low, 1 + clip_high))

    * ``dual_clip = c > 1`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games
      with Deep RL"): for ``A_t < 0`` the loss is additionally bounded,
      ``l_t = min(l_t, -c * A_t)``.
    * ``ratio_level="token"``: ``rho_t = exp(logp_t - old_logp_t)``.
    * ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025, "Group Sequence Policy
      Optimization", GSPO-token form): ``s_i = exp(mean_{t in policy tokens of i}
      (logp_t - old_logp_t))`` and ``rho_t = sg[s_i] * exp(logp_t - sg[logp_t])``, i.e.
      the value of every token's ratio is the sequence ratio ``s_i`` while the
      gradient is ``s_i * grad log pi(y_t)``. With a sequence-constant advantage and
      ``seq_mean_token_mean`` aggregation its gradient equals that of GSPO's
      sequence objective. (GSPO uses much smaller clip ranges, e.g. 3e-4 / 4e-4.)
    * ``rollout_logp`` given (truncated importance sampling, Yao et al. 2025, "Your
      Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the loss is
      multiplied by ``w_t = sg[min(exp(old_logp_t - rollout_logp_t), tis_cap)]``
      correcting the mismatch between the inference engine that sampled
      (``rollout_logp``) and the trainer's ``old_logp`` (``tis_cap=None``: no cap).

    Log-ratios are taken as 0 at masked positions and clamped to +-20 before
    exponentiation (numerical safety). Returns ``(per_token_loss [B, T], stats)``;
    the loss is 0 at masked positions. ``stats`` holds detached scalar tensors
    (masked means over this batch): ``clip_frac`` (fraction of tokens where the
    clipped branch is active), ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``
    (k3 estimate of KL(old || new): ``rho - 1 - log rho`` with the token ratio),
    ``ratio_mean``; plus ``dual_clip_frac`` when ``dual_clip`` is set and
    ``tis_weight_mean``, ``tis_capped_frac`` when ``rollout_logp`` is given.
    """
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError("dual_clip constant must be > 1")
    if ratio_level not in ("token", "sequence"):
        raise ValueError("ratio_level must be 'token' or 'sequence'")
    keep = mask != 0
    zeros = torch.zeros_like(logp)
    token_log_ratio = torch.where(keep, logp - old_logp.to(logp.dtype), zeros)
    if ratio_level == "token":
        log_ratio = token_log_ratio
    else:
        seq_log_ratio = masked_mean(token_log_ratio.detach(), keep, dim=1)
        log_ratio = torch.where(keep, seq_log_ratio.unsqueeze(1) + (logp - logp.detach()), zeros)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    adv = torch.where(keep, advantages.to(logp.dtype), zeros)

    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surr1, surr2)
    stats: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        r = ratio.detach()
        stats["clip_frac"] = masked_mean((surr2 > surr1).to(logp.dtype), keep)
        stats["clip_frac_low"] = masked_mean(((adv < 0) & (r < 1.0 - clip_low)).to(logp.dtype), keep)
        stats["clip_frac_high"] = masked_mean(((adv > 0) & (r > 1.0 + clip_high)).to(logp.dtype), keep)
        tlr = token_log_ratio.detach().clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        stats["approx_kl"] = masked_mean(torch.exp(tlr) - 1.0 - tlr, keep)
        stats["ratio_mean"] = masked_mean(r, keep)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (bound < loss)
        with torch.no_grad():
            stats["dual_clip_frac"] = masked_mean(dual.to(logp.dtype), keep)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    if rollout_logp is not None:
        with torch.no_grad():
            lw = torch.where(keep, old_logp.to(logp.dtype) - rollout_logp.to(logp.dtype), zeros)
            w = torch.exp(lw.clamp(max=_LOG_RATIO_LIMIT))
            if tis_cap is not None:
                stats["tis_capped_frac"] = masked_mean((w > tis_cap).to(logp.dtype), keep)
                w = w.clamp(max=tis_cap)
            else:
                stats["tis_capped_frac"] = torch.zeros((), dtype=logp.dtype, device=logp.device)
            stats["tis_weight_mean"] = masked_mean(w, keep)
        loss = loss * w
    loss = torch.where(keep, loss, zeros)
    return loss, stats


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every policy loss receives (``rlhf.algos.registry``): token tensors ``[B, T]`` of one
    micro-batch (``logp`` with gradient; ``old_logp`` the anchor of the ratio; ``rollout_logp``
    the engine's, None unless ``algo.tis_cap`` is set) and the ``algo`` settings of that name."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logp: Optional[torch.Tensor] = None
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    ratio_level: str = "token"
    tis_cap: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05


@register_policy_loss("clip")
def clipped_policy_loss(x: PolicyLossInputs) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The clipped surrogate, :func:`policy_loss` with the ``algo`` settings."""
    return policy_loss(x.logp, x.old_logp, x.advantages, x.mask, clip_low=x.clip_low, clip_high=x.clip_high,
                       dual_clip=x.dual_clip, ratio_level=x.ratio_level, rollout_logp=x.rollout_logp,
                       tis_cap=x.tis_cap)


def _token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``log rho_t``, ``rho_t``) per token, 0 / 1 at masked positions, the log clamped to +-20."""
    lr = torch.where(keep, logp - old_logp.to(logp.dtype), torch.zeros_like(logp))
    lr = lr.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return lr, torch.exp(lr)


def _ratio_stats(log_ratio: torch.Tensor, keep: torch.Tensor) -> Dict[str, torch.Tensor]:
    with torch.no_grad():
        lr = log_ratio.detach()
        return {"approx_kl": masked_mean(torch.exp(lr) - 1.0 - lr, keep), "ratio_mean": masked_mean(torch.exp(lr), keep)}


def _rollout_correction(loss: torch.Tensor, x: "PolicyLossInputs", keep: torch.Tensor,
                        stats: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``loss`` times the truncated importance weight of :func:`policy_loss` when ``rollout_logp`` is given."""
    if x.rollout_logp is None:
        return loss
    with torch.no_grad():
        lw = torch.where(keep, x.old_logp.to(loss.dtype) - x.rollout_logp.to(loss.dtype), torch.zeros_like(loss))
        w = torch.exp(lw.clamp(max=_LOG_RATIO_LIMIT))
        capped = (w > x.tis_cap) if x.tis_cap is not None else torch.zeros_like(keep)
        if x.tis_cap is not None:
            w = w.clamp(max=x.tis_cap)
        stats["tis_capped_frac"] = masked_mean(capped.to(loss.dtype), keep)
        stats["tis_weight_mean"] = masked_mean(w, keep)
    return loss * w


@register_policy_loss("cispo")
def cispo_policy_loss(x: PolicyLossInputs) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention", eq. 4): clip the importance-sampling WEIGHT, not the update::

        l_t = -sg[clip(rho_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t)

    so every token keeps a gradient ``-w_t A_t grad log pi(y_t)`` (the clipped surrogate drops tokens
    whose ratio left the range, often the rare "fork" tokens of long reasoning). The paper sets no
    lower bound (``clip_low = 1``: the weight's floor is 0) and tunes only ``clip_high``; aggregated
    by ``token_mean`` its objective is the paper's ``1 / sum_i |o_i|``. The value of ``l_t`` carries
    ``log pi`` itself, so only its gradient (and its change) is meaningful. Stats: ``clip_frac``
    (tokens whose weight was clipped), ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``,
    ``ratio_mean`` (and the TIS stats of :func:`policy_loss` with ``rollout_logp``)."""
    if not (0.0 <= x.clip_low <= 1.0) or x.clip_high < 0.0:
        raise ValueError("cispo needs 0 <= clip_low <= 1 and clip_high >= 0")
    keep = x.mask != 0
    log_ratio, ratio = _token_ratio(x.logp, x.old_logp, keep)
    w = ratio.detach().clamp(1.0 - x.clip_low, 1.0 + x.clip_high)
    adv = torch.where(keep, x.advantages.to(x.logp.dtype), torch.zeros_like(x.logp))
    loss = -w * adv * torch.where(keep, x.logp, torch.zeros_like(x.logp))
    stats = _ratio_stats(log_ratio, keep)
    with torch.no_grad():
        r = ratio.detach()
        low, high = r < 1.0 - x.clip_low, r > 1.0 + x.clip_high
        stats["clip_frac"] = masked_mean((low | high).to(x.logp.dtype), keep)
        stats["clip_frac_low"] = masked_mean(low.to(x.logp.dtype), keep)
        stats["clip_frac_high"] = masked_mean(high.to(x.logp.dtype), keep)
    loss = _rollout_correction(loss, x, keep, stats)
    return torch.where(keep, loss, torch.zeros_like(loss)), stats


@register_policy_loss("sapo")
def sapo_policy_loss(x: PolicyLossInputs) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate on the ratio
    instead of the hard clip::

        l_t = -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A_t,   tau = tau_pos if A_t > 0 else tau_neg

    Its gradient is ``-A_t * g_t * rho_t * grad log pi(y_t)`` with ``g_t = 4 s (1 - s)``,
    ``s = sigmoid(tau (rho_t - 1))``: 1 on-policy (the plain policy gradient there) and decaying
    smoothly as the ratio leaves 1, faster for the larger temperature (the paper's ``tau_neg >
    tau_pos``: negative updates are damped sooner). Stats: ``gate_mean`` (mean ``g_t``),
    ``approx_kl``, ``ratio_mean`` (and the TIS stats with ``rollout_logp``)."""
    if x.tau_pos <= 0 or x.tau_neg <= 0:
        raise ValueError("sapo needs tau_pos > 0 and tau_neg > 0")
    keep = x.mask != 0
    log_ratio, ratio = _token_ratio(x.logp, x.old_logp, keep)
    adv = torch.where(keep, x.advantages.to(x.logp.dtype), torch.zeros_like(x.logp))
    tau = torch.where(adv > 0, torch.full_like(adv, x.tau_pos), torch.full_like(adv, x.tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * s * adv
    stats = _ratio_stats(log_ratio, keep)
    with torch.no_grad():
        sd = s.detach()
        stats["gate_mean"] = masked_mean(4.0 * sd * (1.0 - sd), keep)
    loss = _rollout_correction(loss, x, keep, stats)
    return torch.where(keep, loss, torch.zeros_like(loss)), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: Optional[float] = 0.2,
) -> torch.Tensor:
    """Clipped value loss (PPO value clipping, as in the OpenAI baselines PPO2)::

        V_clip = V_old + clip(V - V_old, -clip, clip)
        l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    ``clip=None`` gives the plain ``0.5 * (V - R)^2``. Returns per-token ``[B, T]``,
    0 at masked positions.
    """
    keep = mask != 0
    err = values - returns.to(values.dtype)
    l = err * err
    if clip is not None:
        old = old_values.to(values.dtype)
        v_clip = old + (values - old).clamp(-clip, clip)
        ec = v_clip - returns.to(values.dtype)
        l = torch.maximum(l, ec * ec)
    return torch.where(keep, 0.5 * l, torch.zeros_like(l))


# --------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------

MaskOrMasks = Union[torch.Tensor, Sequence[torch.Tensor]]


def aggregation_denominator(
    mask: MaskOrMasks, mode: str, max_response_length: Optional[int] = None
) -> float:
    """Global denominator of the loss for ``mode`` (see module docstring).

    * ``token_mean``: ``sum_{b,t} [mask != 0]`` (policy tokens);
    * ``seq_mean_token_sum`` / ``seq_mean_token_mean``: number of rows with at least
      one policy token;
    * ``seq_mean_token_sum_norm``: that number times ``L = max_response_length``
      (default: the mask width ``T``; pass it explicitly when micro-batches are
      padded to different widths or in data parallel).

    ``mask`` is the mask of the WHOLE batch, or a list of the masks of all its
    micro-batches. The value is additive over disjoint shards: with data
    parallelism, compute it on each rank and all-reduce with SUM.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {LOSS_AGGREGATIONS}")
    masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
    if mode == "token_mean":
        return float(sum(int((m != 0).sum().item()) for m in masks))
    n_seq = sum(int((m != 0).any(dim=-1).sum().item()) for m in masks)
    if mode == "seq_mean_token_sum_norm":
        L = max_response_length if max_response_length is not None else max((m.shape[-1] for m in masks), default=0)
        return float(n_seq * L)
    return float(n_seq)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    denominator: Optional[Union[float, torch.Tensor]] = None,
    max_response_length: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar: ``sum_i num_i / denominator``.

    ``num_i = sum_t l[i, t] * [mask != 0]`` for ``token_mean``, ``seq_mean_token_sum``
    and ``seq_mean_token_sum_norm`` (Dr. GRPO, Liu et al. 2025: the token sum divided
    by a constant length), and ``num_i = sum_t l[i, t] / n_i`` (0 for ``n_i = 0``) for
    ``seq_mean_token_mean`` (GRPO's per-sequence mean, Shao et al. 2024). For
    ``token_mean`` the result is the token-level mean of DAPO (Yu et al. 2025).

    ``denominator``: the GLOBAL value from :func:`aggregation_denominator`; if None
    it is computed from this ``mask`` (i.e. this batch is the whole batch). A zero
    denominator gives a zero loss.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {LOSS_AGGREGATIONS}")
    keep = mask != 0
    pt = torch.where(keep, per_token, torch.zeros_like(per_token))
    if mode == "seq_mean_token_mean":
        n = keep.sum(dim=-1).to(pt.dtype)
        num = (pt.sum(dim=-1) / n.clamp(min=1.0)).sum()
    else:
        num = pt.sum()
    if denominator is None:
        denominator = aggregation_denominator(mask, mode, max_response_length)
    if isinstance(denominator, torch.Tensor):
        den = denominator.to(pt.dtype)
        return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num * 0.0)
    if denominator <= 0:
        return num * 0.0
    return num / float(denominator)


def micro_batch_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    denominator: Union[float, torch.Tensor],
    dp_world_size: int = 1,
) -> torch.Tensor:
    """Loss of one micro-batch, to be back-propagated as is (gradient accumulation).

    ``loss = dp_world_size * sum_{i in micro-batch} num_i / denominator``

    where ``denominator`` is the global one (all micro-batches of all data-parallel
    ranks, :func:`aggregation_denominator` all-reduced with SUM). Summing these
    losses over a rank's micro-batches gives that rank's share of the global loss;
    the factor ``dp_world_size`` cancels the gradient *averaging* over ranks done by
    DDP / DeepSpeed, so the averaged gradient equals the gradient of the global
    loss. (If an engine also divides the loss by the number of accumulation steps,
    as DeepSpeed's ``engine.backward`` does by default, undo or disable that too.)
    For logging the global loss, all-reduce the per-rank sums with SUM and divide
    by ``dp_world_size``.
    """
    if dp_world_size < 1:
        raise ValueError("dp_world_size must be >= 1")
    return aggregate(per_token, mask, mode, denominator) * float(dp_world_size)
