"""The fused AdamW's own step checks (rlhf.workers.trained.StepChecks: global norm, clipping, skip) in
place of DeepSpeed's (rlhf.workers.model.optimizer_checks_its_step: CUDA ZeRO-1/2 runs), through a real
DeepSpeed ZeRO engine on CPU (gloo, float32: the same optimizer code path; DeepSpeed's bf16 engine needs
a GPU, tests/gpu/test_optimizer_step.py). Against DeepSpeed's own norm and clipping, over two ranks:
the same weights and the same reported norm; a checkpoint saved with DeepSpeed's clipping resumes into
a run whose optimizer clips (rlhf.workers.model.load_engine_checkpoint), keeping the run's clipping."""

from __future__ import annotations

import copy
import os

import pytest
import torch

CLIP = 0.05  # below the gradients' norm (~0.3-1): every step is clipped


def _engine(model, own_checks: bool, zero: int):
    import deepspeed

    from rlhf.workers.trained import StepChecks

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
           "gradient_clipping": 0.0 if own_checks else CLIP,
           "zero_optimization": {"stage": zero, **({"compute_grad_norm": False} if own_checks else {})},
           "bf16": {"enabled": False, "check_grad_overflow": not own_checks},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if own_checks:
        opt.register_step_pre_hook(StepChecks(CLIP))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, opt


def _steps(engine, rank: int, n: int, poison_step: int = -1) -> list[float]:
    """``n`` optimizer steps of two micro-batches each (each rank its own data); the global grad norms."""
    from rlhf.workers.trained import TrainedWorker

    worker = TrainedWorker.__new__(TrainedWorker)  # only its _step: the norm as the product reads it
    worker.engine, worker._adamw = engine, getattr(engine, "_own_adamw", None)
    norms = []
    g = torch.Generator().manual_seed(100 + rank)
    for s in range(n):
        for i in range(2):
            x = torch.randn(4, 16, generator=g)
            loss = engine(x).pow(2).mean()
            if s == poison_step and i == 1:
                loss = loss * float("nan")
            engine.set_gradient_accumulation_boundary(i == 1)
            engine.backward(loss, scale_wrt_gas=False)
            worker._step()
        norms.append(worker.last_grad_norm)
    return norms


def _check(rank: int, init: str, out: str, zero: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    from rlhf.workers.base import skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    import deepspeed

    from rlhf.workers.model import load_engine_checkpoint

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    theirs, _ = _engine(copy.deepcopy(model), own_checks=False, zero=zero)
    ours, adamw = _engine(copy.deepcopy(model), own_checks=True, zero=zero)
    ours._own_adamw = adamw
    result = {"theirs": _steps(theirs, rank, 3), "ours": _steps(ours, rank, 3)}
    weights = lambda e: [p.detach().clone() for p in e.module.parameters()]  # noqa: E731
    result["max_weight_diff"] = max(float((a - b).abs().max()) for a, b in zip(weights(theirs), weights(ours)))

    # a NaN on one step of rank 0 only: both ranks skip it (weights as they were), the norm reported inf
    before = weights(ours)
    result["poisoned_norms"] = _steps(ours, rank, 1, poison_step=0 if rank == 0 else -1)
    result["skipped"] = all(torch.equal(a, b) for a, b in zip(before, weights(ours)))

    # DeepSpeed's clipping saved in a checkpoint; resumed where the optimizer clips: the run's clipping stays
    theirs.save_checkpoint(f"{out}/ckpt", tag="ds")
    loaded = load_engine_checkpoint(ours, f"{out}/ckpt")
    result["loaded"] = loaded is not None
    result["clip_after_load"] = (ours.optimizer.clip_grad, ours.optimizer.compute_grad_norm)
    result["resumed_weight_diff"] = max(float((a - b).abs().max()) for a, b in zip(weights(theirs), weights(ours)))
    result["after_resume"] = {"theirs": _steps(theirs, rank, 1), "ours": _steps(ours, rank, 1)}
    result["after_resume_weight_diff"] = max(float((a - b).abs().max())
                                             for a, b in zip(weights(theirs), weights(ours)))
    torch.save(result, f"{out}/{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("zero", [1, 2])
def test_the_optimizers_norm_clip_and_skip_equal_deepspeeds_over_two_ranks(tmp_path, zero):
    import torch.multiprocessing as mp

    mp.spawn(_check, args=(f"file://{tmp_path}/store", str(tmp_path), zero), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert all(n > 2 * CLIP for n in r["theirs"]), r["theirs"]  # every step was clipped
        assert r["ours"] == pytest.approx(r["theirs"], rel=1e-5), r
        assert r["max_weight_diff"] < 1e-6, r
        assert r["poisoned_norms"] == [float("inf")] and r["skipped"], r
        assert r["loaded"] and r["clip_after_load"] == (0.0, False), r
        assert r["resumed_weight_diff"] == 0.0, r
        assert r["after_resume"]["ours"] == pytest.approx(r["after_resume"]["theirs"], rel=1e-5), r
        assert r["after_resume_weight_diff"] < 1e-6, r
