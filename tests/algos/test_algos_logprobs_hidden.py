"""logprobs_from_hidden (chunked LM head + log-softmax + entropy) against a float64 reference
written from the definitions, values and gradients."""

import math

import pytest
import torch

from rlhf.algos import logprobs_from_hidden


def _reference(h, W, y, tau):
    """Plain loops: logits, softmax, log-prob of the token, entropy — float64."""
    h, W = h.detach(), W.detach()
    M, V = h.shape[0], W.shape[0]
    lp, ent = [], []
    for m in range(M):
        z = [sum(h[m, k] * W[v, k] for k in range(h.shape[1])) / tau for v in range(V)]
        mx = max(float(x) for x in z)
        lse = mx + math.log(sum(math.exp(float(x) - mx) for x in z))
        lp.append(float(z[y[m]]) - lse)
        ent.append(-sum(math.exp(float(x) - lse) * (float(x) - lse) for x in z))
    return torch.tensor(lp, dtype=torch.float64), torch.tensor(ent, dtype=torch.float64)


class _WrappedHead(torch.nn.Module):
    """Not a plain nn.Linear (as a LoRA-adapted or ZeRO-3 head): the checkpointed-autograd path."""

    def __init__(self, linear):
        super().__init__()
        self.inner = linear

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1 << 26, 11 * 3])  # one chunk; chunks of 3 rows (vocab 11)
def test_values_match_float64_loops(tau, chunk, wrapped):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64)
    W = torch.randn(11, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (7,), generator=g)
    head = torch.nn.Linear(5, 11, bias=False).double()
    head.weight.data.copy_(W)
    head = _WrappedHead(head) if wrapped else head
    lp, ent = logprobs_from_hidden(h, head, y, tau, with_entropy=True, chunk_elements=chunk)
    ref_lp, ref_ent = _reference(h, W, y, tau)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)


KEEP = [pytest.param(None, id="kept"), pytest.param(0, id="recomputed")]  # the plain head's logits


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("wrapped", [False, True])  # written-out backward / checkpointed autograd
@pytest.mark.parametrize("grads", ["both", "logp", "entropy", "no_entropy"])
def test_gradients_match_full_softmax_autograd(wrapped, grads, keep):
    """Chunked gradients equal autograd through the full float64 softmax: with gradients from
    log-probs and entropy, from either alone (the other output unused), and without entropy; a
    plain head's logits kept from the forward or recomputed in the backward."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    linear = torch.nn.Linear(6, 13, bias=False).double()
    head = _WrappedHead(linear) if wrapped else linear
    y = torch.randint(0, 13, (9,), generator=g)
    a, b = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    if grads in ("logp", "no_entropy"):
        b = torch.zeros_like(b)
    if grads == "entropy":
        a = torch.zeros_like(a)
    lp, ent = logprobs_from_hidden(h, head, y, 0.8, with_entropy=grads != "no_entropy", chunk_elements=13 * 2,
                                   keep_elements=keep)
    assert (ent is None) == (grads == "no_entropy")
    loss = {"both": lambda: a * lp + b * ent, "logp": lambda: a * lp, "no_entropy": lambda: a * lp,
            "entropy": lambda: b * ent}[grads]()
    loss.sum().backward()
    g_h, g_w = h.grad.clone(), linear.weight.grad.clone()
    h.grad, linear.weight.grad = None, None
    z = linear(h) / 0.8
    logp_all = torch.log_softmax(z, -1)
    ref = (a * logp_all.gather(1, y[:, None]).squeeze(1) - b * (logp_all.exp() * logp_all).sum(-1)).sum()
    ref.backward()
    torch.testing.assert_close(g_h, h.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_w, linear.weight.grad, rtol=0, atol=1e-12)


def test_bf16_head_gives_float32_results_close_to_float64():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(16, 32, generator=g)
    head = torch.nn.Linear(32, 50, bias=False)
    y = torch.randint(0, 50, (16,), generator=g)
    lp, ent = logprobs_from_hidden(h.bfloat16(), head.bfloat16(), y, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = _reference(h.double(), head.weight.double(), y, 1.0)
    assert (lp.double() - ref_lp).abs().max() < 0.1  # bf16 logits
    assert (ent.double() - ref_ent).abs().max() < 0.1


def test_empty_and_bad_shapes():
    head = torch.nn.Linear(4, 5, bias=False)
    lp, ent = logprobs_from_hidden(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    with pytest.raises(ValueError):
        logprobs_from_hidden(torch.zeros(3, 4), head, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        logprobs_from_hidden(torch.zeros(3, 4), head, torch.zeros(3, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("keep", KEEP)
def test_bf16_gradients_close_to_float64(keep):
    """bf16 weights and hidden states: the written-out backward (kept logits: one matmul per
    gradient; recomputed: float32 sums over chunks) stays within bf16 rounding of the float64
    gradients."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(40, 32, generator=g)
    W = torch.randn(50, 32, generator=g) * 0.3
    y = torch.randint(0, 50, (40,), generator=g)
    a = torch.randn(40, generator=g)
    head = torch.nn.Linear(32, 50, bias=False).bfloat16()
    head.weight.data.copy_(W.bfloat16())
    hb = h.bfloat16().requires_grad_()
    lp, ent = logprobs_from_hidden(hb, head, y, with_entropy=True, chunk_elements=50 * 7, keep_elements=keep)
    (a * lp + 0.1 * a * ent).sum().backward()
    hd = h.bfloat16().double().requires_grad_()
    Wd = W.bfloat16().double().requires_grad_()
    logp_all = torch.log_softmax(hd @ Wd.t(), -1)
    ref = (a.double() * logp_all.gather(1, y[:, None]).squeeze(1)
           - 0.1 * a.double() * (logp_all.exp() * logp_all).sum(-1)).sum()
    ref.backward()
    for got, want in ((hb.grad, hd.grad), (head.weight.grad, Wd.grad)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel


@pytest.mark.parametrize("M, keep, kept", [(9, None, True), (9, 9 * 13, True), (9, 9 * 13 - 1, False), (9, 0, False)])
def test_logits_are_kept_only_within_the_limit_and_only_for_a_backward(M, keep, kept):
    """The [M, V] logits are saved for the backward exactly when M·V <= keep_elements (the plan
    counts them: rlhf.plan.memory.logprob_pass_gb), and never by a pass without gradients."""
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(6, 13, bias=False)
    y = torch.randint(0, 13, (M,), generator=g)
    for needs_grad in (True, False):
        h = torch.randn(M, 6, generator=g, requires_grad=needs_grad)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            with torch.set_grad_enabled(needs_grad):
                head.weight.requires_grad_(needs_grad)
                logprobs_from_hidden(h, head, y, with_entropy=True, chunk_elements=13 * 2, keep_elements=keep)
        assert ((M, 13) in saved) == (kept and needs_grad), saved


@pytest.mark.parametrize("entropy", [False, True])
def test_the_target_columns_gradient_is_rounded_once_where_its_probability_is_near_one(entropy):
    """``g (1 - p_y)`` with ``p_y`` ≈ 0.998: in bf16 ``-p_y g`` rounds to a step of 2^-8 g, so adding ``g``
    after rounding would be wrong by ~100 %; the target column is formed in float32 and rounded once."""
    from rlhf.algos.logprobs import _chunk_grad_into

    V, tau = 50, 1.3
    z = torch.zeros(3, V, dtype=torch.float64)
    y = torch.tensor([4, 17, 49])
    z[torch.arange(3), y] = 8.0 * tau  # z / tau = 8 at the target: p_y = e^8 / (e^8 + 49) ≈ 0.9837... per row
    z[1, 0] = -3.0
    logits = z.bfloat16()
    zd = logits.double() / tau
    lse = torch.logsumexp(zd, -1)
    p = torch.softmax(zd, -1)
    ez = (p * zd).sum(-1)
    g = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    e = torch.tensor([0.3, 0.2, -0.1], dtype=torch.float64) if entropy else None
    want = -p * (g[:, None] + (e[:, None] * (zd - ez[:, None]) if entropy else 0.0))
    want[torch.arange(3), y] += g
    want = want / tau
    got = logits.clone()
    _chunk_grad_into(got, y, lse.float(), ez.float() if entropy else None, g.float(),
                     e.float() if entropy else None, tau)
    at_y = got.double()[torch.arange(3), y]
    assert ((at_y - want[torch.arange(3), y]).abs() / want[torch.arange(3), y].abs()).max() < 2**-7
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-6)


def test_the_kept_chunks_eager_gradient_pass_holds_8_bytes_per_logit():
    """The plan's KEPT_CHUNK_BYTES_PER_LOGIT (eager): the gradient pass over a kept bf16 chunk allocates one
    float32 copy and, with an entropy gradient, the float32 softmax (8 B per logit at its peak) and writes
    the result into the chunk in place; counted here from every tensor the pass's operators allocate."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf.algos.logprobs import _chunk_grad_into
    from rlhf.plan.memory import KEPT_CHUNK_BYTES_PER_LOGIT

    class Peak(TorchDispatchMode):
        live = peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                    n = t.untyped_storage().nbytes()
                    Peak.live += n
                    Peak.peak = max(Peak.peak, Peak.live)
                    weakref.finalize(t.untyped_storage(), lambda n=n: setattr(Peak, "live", Peak.live - n))
            return out

    rows, V = 64, 1000
    g0 = torch.Generator().manual_seed(6)
    logits = torch.randn(rows, V, generator=g0).bfloat16()
    y = torch.randint(0, V, (rows,), generator=g0)
    lse, ez, g, e = (torch.randn(rows, generator=g0) for _ in range(4))
    before = logits.data_ptr()
    with Peak():
        _chunk_grad_into(logits, y, lse, ez, g, e, 0.9)
    assert logits.data_ptr() == before
    per_logit = Peak.peak / (rows * V)
    assert KEPT_CHUNK_BYTES_PER_LOGIT - 0.5 < per_logit <= KEPT_CHUNK_BYTES_PER_LOGIT + 0.1, per_logit
