"""Log-probabilities and entropy straight from hidden states, chunk by chunk.

For the policy's tokens only (M of them, not every position of the batch), with the LM head
``W`` and temperature ``tau``::

    z_m      = (h_m W^T) / tau                        logits of position m, computed in chunks
    logp_m   = z_m[y_m] - logsumexp(z_m)
    H_m      = logsumexp(z_m) - sum_v softmax(z_m)_v z_m,v          (entropy, same pass)

The float32 work (log-sum-exp, entropy, the gradient) runs a chunk of rows at a time, so float32
copies of the logits exist for one chunk only, and the head is one matmul over the response tokens
instead of the model's full ``[B, T, V]`` head. The ``[M, V]`` logits themselves (in the head's
dtype) are kept for the backward only by a plain head being differentiated, within a limit (below).

With a plain linear head (no bias, weight not partitioned) the backward pass is written out:
forward keeps ``h``, ``lse_m`` and ``E_p[z_m]``, and the backward forms

    d loss / d z_m = g_m (onehot(y_m) - p_m) - e_m p_m (z_m - E_p[z_m])

(``g``, ``e``: the gradients reaching ``logp`` and ``H``), then ``dh = dz W / tau`` and
``dW = dz^T h / tau``: a handful of passes over each chunk instead of autograd's generic
log-softmax/softmax backward. Where the ``[M, V]`` logits fit under ``keep_elements``
(``KEEP_ELEMENTS``; the plan counts them), the forward computes them in one matmul and keeps them
in the head's dtype; the backward overwrites each chunk with its ``dz`` in place, and ``dh`` and
``dW`` are one matmul each over all M rows (their sums accumulated inside the matmul, rounded
once). Otherwise the forward keeps only the per-row statistics, and the backward recomputes each
chunk's logits and sums ``dW`` over the chunks in float32: one more ``M x V x h`` matmul and a
float32 pass over the head's weight per chunk. Any other head (a LoRA-adapted one, a
ZeRO-3-partitioned one) is called as a module, each chunk under activation checkpointing, and
autograd differentiates it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

# logits (chunk rows × vocabulary) computed at once: 2^26 float32 values are 256 MB; on a GPU
# 2^28 (1 GB), so that a 150k vocabulary still gets chunks of ~1,800 rows (fewer, larger matmuls).
# A bf16 chunk's eager working set: its logits (2 B per logit), one float32 copy (4 B; 8 B in a
# backward with an entropy gradient) and the bf16 gradient (2 B)
CHUNK_ELEMENTS = 1 << 26
CUDA_CHUNK_ELEMENTS = 1 << 28
# A plain head's [M, V] logits are kept from the forward for the backward up to this many (2^33:
# 16 GiB of bf16; a 0.5B Qwen's 32k-token micro-batch is ~4.4e9): the backward then skips
# recomputing them, one matmul of the head's size. On CPU up to 2^28 (1 GiB of float32).
KEEP_ELEMENTS = 1 << 28
CUDA_KEEP_ELEMENTS = 1 << 33


def _chunk(head: Callable, h: torch.Tensor, y: torch.Tensor, tau: float, with_entropy: bool):
    z = head(h)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if tau != 1.0:
        z = z / tau
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, y.unsqueeze(1)).squeeze(1) - lse
    if not with_entropy:
        return logp, None
    p = torch.softmax(z, dim=-1)
    return logp, lse - (p * z).sum(-1)


def _plain_linear_weight(head) -> Optional[torch.Tensor]:
    """The weight of a bias-free ``nn.Linear`` whose parameters are whole (not ZeRO-3 shards)."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    w = head.weight
    return None if hasattr(w, "ds_id") else w


class _LinearLogprobs(torch.autograd.Function):
    """``(logp, entropy)`` of ``tokens`` under ``(hidden @ weight^T) / tau``, chunked (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, tau: float, with_entropy: bool, rows: int,  # type: ignore[override]
                compile: bool = False, keep: bool = False):
        M = hidden.shape[0]
        dt = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(M, dtype=dt, device=hidden.device)
        lse = torch.empty(M, dtype=dt, device=hidden.device)
        ez = torch.empty(M, dtype=dt, device=hidden.device) if with_entropy else lse
        stats = _kernel(_chunk_stats, hidden, compile)
        logits = hidden @ weight.t() if keep else None  # [M, V], kept for the backward
        for s in range(0, M, rows):
            if keep:  # the statistics work in place on a float32 copy: float32 logits are copied first
                z = logits[s:s + rows]
                z = z.clone() if z.dtype == dt else z
            else:
                z = hidden[s:s + rows] @ weight.t()
            lp_c, lse_c, ez_c = stats(z, tokens[s:s + rows], tau, with_entropy)
            logp[s:s + rows], lse[s:s + rows] = lp_c, lse_c
            if with_entropy:
                ez[s:s + rows] = ez_c
        ctx.save_for_backward(hidden, weight, tokens, lse, ez, logits)
        ctx.set_materialize_grads(False)  # an unused entropy gets None, not zeros: its term is skipped
        ctx.tau, ctx.rows, ctx.with_entropy, ctx.compile = tau, rows, with_entropy, compile
        return logp, ((lse - ez) if with_entropy else None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        hidden, weight, tokens, lse, ez, logits = ctx.saved_tensors
        tau, rows = ctx.tau, ctx.rows
        dt = lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dt)
        e_all = g_ent.to(dt) if (ctx.with_entropy and g_ent is not None) else None
        grad_into = _kernel(_chunk_grad_into, hidden, ctx.compile)
        if logits is not None:  # kept: each chunk becomes its dz in place, then one matmul per gradient
            for s in range(0, hidden.shape[0], rows):
                sl = slice(s, s + rows)
                e, ez_c = (None, None) if e_all is None else (e_all[sl], ez[sl])
                grad_into(logits[sl], tokens[sl], lse[sl], ez_c, g_logp[sl], e, tau)
            d_hidden = (logits @ weight).to(hidden.dtype) if need_h else None
            d_weight = (logits.t() @ hidden.to(weight.dtype)) if need_w else None
            return d_hidden, d_weight, None, None, None, None, None, None
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows]
            sl = slice(s, s + rows)
            e, ez_c = (None, None) if e_all is None else (e_all[sl], ez[sl])
            dz = h @ weight.t()  # the chunk's logits again, then their gradient in place
            grad_into(dz, tokens[sl], lse[sl], ez_c, g_logp[sl], e, tau)
            if need_h:
                d_hidden[s:s + rows] = (dz @ weight).to(hidden.dtype)
            if need_w:  # the chunk's product in the weights' dtype, summed in float32
                d_weight.add_(dz.t() @ h.to(weight.dtype))
        return d_hidden, (d_weight.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def _chunk_stats(logits: torch.Tensor, tokens: torch.Tensor, tau: float, with_entropy: bool):
    """A chunk's ``(logp, lse, E_p[z])`` from its logits in the head's dtype (``z`` = logits / tau,
    in float32 or wider). Works in place on one float32 copy of the chunk (a chunk is up to 1 GiB
    of float32): float32 ``logits`` are overwritten."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if tau != 1.0:
        z.div_(tau)
    m = z.amax(-1, keepdim=True)
    z_y = z.gather(1, tokens[:, None]).squeeze(1)
    q = z.sub_(m).exp_()  # exp(z - max): the unnormalised softmax
    s = q.sum(-1)
    m = m.squeeze(1)
    lse = s.log().add_(m)
    # E_p[z] = max + sum q log q / s: q log q in place needs no second chunk-sized tensor
    ez = q.xlogy_(q).sum(-1).div_(s).add_(m) if with_entropy else None
    return z_y - lse, lse, ez


def _chunk_grad_into(logits, tokens, lse, ez, g, e, tau: float) -> None:
    """``d loss / d logits`` of a chunk written over its logits (in their dtype):
    ``(-p (g + e (z - E_p[z])) + onehot(y) g) / tau``; ``(onehot(y) - p) g / tau`` when there is no
    entropy gradient (``e`` and ``ez`` None). Every column is first written as if it were not the
    target, then each row's target column from its logit gathered beforehand, in float32 before
    rounding (``g (1 - p_y)`` cancels where ``p_y`` is near 1): an add into the chunk would make the
    compiled pass keep a float32 chunk and copy it again (BENCHMARKS §12). In place on one float32
    copy of the chunk (two with an entropy gradient); float32 ``logits`` are that copy."""
    idx = tokens[:, None]
    z_y = logits.gather(1, idx).squeeze(1).to(lse.dtype)
    z = logits.to(lse.dtype)
    if tau != 1.0:
        z.div_(tau)
        z_y = z_y / tau
    if e is None:
        dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    else:
        p = (z - lse[:, None]).exp_()
        dz = z.sub_(ez[:, None]).mul_(e[:, None]).add_(g[:, None]).mul_(p).neg_()
        del p
    if tau != 1.0:
        dz.div_(tau)
    logits.copy_(dz)
    p_y = (z_y - lse).exp()
    target = g - p_y * g if e is None else g - p_y * (g + e * (z_y - ez))
    if tau != 1.0:
        target = target / tau
    logits.scatter_(1, idx, target.to(logits.dtype)[:, None])


_compiled: dict = {}


def _kernel(fn, like: torch.Tensor, compile: bool):
    """``fn`` compiled by torch.compile (its elementwise passes over a chunk fused into a few
    kernels; shapes dynamic) when ``compile`` and on CUDA; ``fn`` itself otherwise, and from the
    first call whose compilation fails on (one warning)."""
    if not compile or not like.is_cuda:
        return fn
    if fn not in _compiled:
        _compiled[fn] = _guarded(fn, torch.compile(fn, dynamic=True))
    return _compiled[fn]


def _guarded(fn, compiled):
    def call(*args):
        if _compiled.get(fn) is fn:
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 - an inductor/Triton failure must not stop training
            import warnings

            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}); running it eagerly")
            _compiled[fn] = fn
            return fn(*args)

    return call


def logprobs_from_hidden(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = False, vocab: Optional[int] = None,
                         chunk_elements: Optional[int] = None, compile: bool = False,
                         keep_elements: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [M], entropy [M] or None)`` of ``tokens [M]`` under ``head(hidden [M, H]) / temperature``
    (see the module doc). ``vocab`` sizes the chunks (default: one probe of the head on one row).
    Results are float32 (float64 if the head computes in float64). Differentiable in ``hidden``
    and the head's parameters. ``compile``: a plain linear head's chunk passes through torch.compile
    (CUDA only; ``train.compile_logprobs``). ``keep_elements``: a plain head differentiated here
    keeps its ``[M, V]`` logits for the backward when ``M·V`` is at most this (default
    ``KEEP_ELEMENTS`` / ``CUDA_KEEP_ELEMENTS``; 0 recomputes them in the backward)."""
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError("hidden must be [M, H] and tokens [M]")
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    M = hidden.shape[0]
    if M == 0:
        z = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return z, (z.clone() if with_entropy else None)
    if vocab is None:
        with torch.no_grad():
            vocab = head(hidden[:1]).shape[-1]
    if chunk_elements is None:
        chunk_elements = CUDA_CHUNK_ELEMENTS if hidden.is_cuda else CHUNK_ELEMENTS
    rows = max(1, chunk_elements // max(int(vocab), 1))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    tokens = tokens.long()
    weight = _plain_linear_weight(head)
    if weight is not None and hidden.dtype == weight.dtype:
        if keep_elements is None:
            keep_elements = CUDA_KEEP_ELEMENTS if hidden.is_cuda else KEEP_ELEMENTS
        keep = grad and M * int(vocab) <= keep_elements
        return _LinearLogprobs.apply(hidden, weight, tokens, float(temperature), with_entropy, rows, compile, keep)
    lps, ents = [], []
    for s in range(0, M, rows):
        h, y = hidden[s:s + rows], tokens[s:s + rows]
        if grad:
            # determinism_check off: a ZeRO-3 head saves its partitioned weight itself, which DeepSpeed
            # has released again (shape [0]) by the time the recompute's metadata is compared, a false
            # mismatch (tests/rl/test_rl_lora.py's two-rank ZeRO-3 run); the chunk is deterministic
            lp, ent = checkpoint(_chunk, head, h, y, float(temperature), with_entropy, use_reentrant=False,
                                 determinism_check="none")
        else:
            lp, ent = _chunk(head, h, y, float(temperature), with_entropy)
        lps.append(lp)
        if with_entropy:
            ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
