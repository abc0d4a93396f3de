"""On CUDA ZeRO-1/2 runs the fused AdamW itself takes the gradient norm, clips and skips a step with a
non-finite gradient (rlhf.workers.trained.StepChecks), where ds_config turns DeepSpeed's norm, clipping
and bf16 overflow check off (rlhf.workers.model.optimizer_checks_its_step); everywhere else DeepSpeed's
stay. The fused AdamW runs on CPU too, so the checks themselves are tested here; through a DeepSpeed
engine on CPU in tests/workers/test_optimizer_checks_deepspeed.py, on the GPU in
tests/gpu/test_optimizer_step.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.workers.model import ds_config, optimizer_checks_its_step
from rlhf.workers.trained import StepChecks, _optimizer


def _spec(device="cuda", dtype="bfloat16", zero=1, offload=False):
    return SimpleNamespace(device=device, model=SimpleNamespace(dtype=dtype),
                           train=SimpleNamespace(zero_stage=zero, offload_optimizer=offload),
                           batch=SimpleNamespace(micro_batch_size=1, grad_accum=1),
                           algo=SimpleNamespace(weight_decay=0.01, max_grad_norm=1.0))


@pytest.mark.parametrize("kw, skips", [({}, True), ({"zero": 2}, True), ({"zero": 0}, False), ({"zero": 3}, False),
                                       ({"offload": True}, False), ({"device": "cpu"}, False),
                                       ({"dtype": "float16"}, False)])
def test_deepspeed_checks_wherever_the_optimizer_does_not(kw, skips):
    spec = _spec(**kw)
    assert optimizer_checks_its_step(spec) is skips
    cfg = ds_config(spec, 0, 0.7, 1)
    assert cfg["bf16"]["check_grad_overflow"] is (not skips)
    assert cfg["gradient_clipping"] == (0.0 if skips else 0.7)  # the optimizer clips to 0.7 instead
    assert cfg["zero_optimization"].get("compute_grad_norm", True) is (not skips)
    assert "compute_grad_norm" not in ds_config(spec, 0, 0.0, 1, optimizer=False)["zero_optimization"]


def _fused_adamw(*params, clip=0.0):
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)  # fused runs on CPU since torch 2.4
    opt.register_step_pre_hook(StepChecks(clip))
    return opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_leaves_weights_moments_and_step_count_as_they_were(bad):
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.full((3,), 2.0))
    opt = _fused_adamw(p, q)
    p.grad, q.grad = torch.ones(4), torch.ones(3)
    opt.step()
    assert float(opt.found_inf) == 0.0 and (p.data < 1).all() and float(opt.state[p]["step"]) == 1
    kept = {name: t.clone() for name, t in (("p", p.data), ("q", q.data), ("m", opt.state[p]["exp_avg"]),
                                             ("v", opt.state[q]["exp_avg_sq"]), ("step", opt.state[p]["step"]))}
    p.grad, q.grad = torch.tensor([1.0, bad, 1.0, 1.0]), torch.ones(3)  # one bad entry in one tensor
    opt.step()
    assert float(opt.found_inf) == 1.0
    for name, t in (("p", p.data), ("q", q.data), ("m", opt.state[p]["exp_avg"]), ("v", opt.state[q]["exp_avg_sq"]),
                    ("step", opt.state[p]["step"])):
        assert torch.equal(t, kept[name]), name
    p.grad, q.grad = torch.ones(4), torch.ones(3)  # the next finite step goes on from where it was
    opt.step()
    assert float(opt.found_inf) == 0.0 and float(opt.state[p]["step"]) == 2 and (p.data < kept["p"]).all()


def test_the_skip_matches_a_step_never_taken():
    """Finite, bad, finite: the weights equal those of the two finite steps alone."""
    torch.manual_seed(0)
    g1, g2 = torch.randn(5), torch.randn(5)
    a, b = torch.nn.Parameter(torch.randn(5)), None
    b = torch.nn.Parameter(a.data.clone())
    opt_a, opt_b = _fused_adamw(a), _fused_adamw(b)
    for g in (g1, torch.full((5,), float("nan")), g2):
        a.grad = g.clone()
        opt_a.step()
    for g in (g1, g2):
        b.grad = g.clone()
        opt_b.step()
    assert torch.equal(a.data, b.data)


@pytest.mark.parametrize("clip", [0.5, 100.0, 0.0])
def test_the_norm_and_the_clip_equal_a_float64_reference(clip):
    """‖g‖₂ over every tensor, and g · min(1, c / (‖g‖ + 1e-6)) before the step (c = 0: no clipping)."""
    torch.manual_seed(1)
    p, q = torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, 5))
    gp, gq = torch.randn(7), torch.randn(3, 5)
    norm = torch.cat([gp.double().flatten(), gq.double().flatten()]).norm()
    scale = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
    p.grad, q.grad = gp.clone(), gq.clone()
    opt = _fused_adamw(p, q, clip=clip)
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(p=p.grad.clone(), q=q.grad.clone()))  # after StepChecks
    opt.step()
    assert float(opt.grad_norm) == pytest.approx(float(norm), rel=1e-6)
    torch.testing.assert_close(seen["p"].double(), gp.double() * scale, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(seen["q"].double(), gq.double() * scale, rtol=1e-6, atol=1e-7)
    assert (scale < 1) is (clip == 0.5)


def test_the_product_optimizer_gets_the_check_only_where_deepspeed_does_not_check():
    for spec, hooked in ((_spec(device="cuda"), True), (_spec(device="cuda", zero=3), False),
                         (_spec(device="cpu"), False)):
        opt = _optimizer(spec, [torch.nn.Parameter(torch.ones(2))], 1e-3)
        checks = [h for h in opt._optimizer_step_pre_hooks.values() if isinstance(h, StepChecks)]
        assert len(checks) == int(hooked) and all(h.max_norm == 1.0 for h in checks)


def _two_ranks(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    p = torch.nn.Parameter(torch.ones(4))
    opt = _fused_adamw(p)
    p.grad = torch.ones(4)
    opt.step()
    before = p.data.clone()
    p.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0]) if rank == 0 else torch.ones(4)  # only rank 0's is bad
    opt.step()
    torch.save({"skipped": torch.equal(p.data, before), "found": float(opt.found_inf)}, f"{out}/{rank}.pt")
    torch.distributed.destroy_process_group()


def test_every_rank_skips_when_one_ranks_partition_is_not_finite(tmp_path):
    """Under ZeRO-1/2 each rank steps its own partition: the flag is reduced over the ranks, so a NaN in
    rank 0's partition skips rank 1's step too (DeepSpeed's check did the same)."""
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(f"file://{tmp_path}/store", str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got == {"skipped": True, "found": 1.0}, (rank, got)


def test_the_product_optimizer_has_one_parameter_group():
    """StepChecks' norm is over the group DeepSpeed steps; one group makes it the global norm."""
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    assert len(_optimizer(_spec(device="cuda"), params, 1e-3).param_groups) == 1
