"""DeepSpeed ZeRO-1 on the GPU with the product's config and optimizer (rlhf.workers.model.ds_config,
rlhf.workers.trained._optimizer): DeepSpeed's norm, clipping and bf16 overflow check are off there, and
a step whose gradients hold a NaN is skipped by the fused AdamW's own checks (weights as they were, the
gradient norm reported inf); the steps around it train as before, their norm reported finite."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _engine():
    import deepspeed

    from rlhf.workers.base import free_port
    from rlhf.workers.model import ds_config
    from rlhf.workers.trained import _optimizer

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        deepspeed.init_distributed(dist_backend="nccl")
    spec = SimpleNamespace(device="cuda", model=SimpleNamespace(dtype="bfloat16"),
                           train=SimpleNamespace(zero_stage=1, offload_optimizer=False),
                           batch=SimpleNamespace(micro_batch_size=1, grad_accum=2),
                           algo=SimpleNamespace(weight_decay=0.0, max_grad_norm=1.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = _optimizer(spec, list(model.parameters()), 1e-2)
    cfg = ds_config(spec, 0, 1.0, 1)
    assert cfg["bf16"]["check_grad_overflow"] is False and cfg["zero_optimization"]["compute_grad_norm"] is False
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    from rlhf.workers.trained import TrainedWorker

    worker = TrainedWorker.__new__(TrainedWorker)  # its _step: the step and its norm as the product reads them
    worker.engine, worker._adamw = engine, opt
    return worker


def _update(worker, poison: bool) -> None:
    """Two micro-batches, the second's loss poisoned with a NaN when ``poison``."""
    engine = worker.engine
    for i in range(2):
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        if poison and i == 1:
            loss = loss * float("nan")
        engine.set_gradient_accumulation_boundary(i == 1)
        engine.backward(loss, scale_wrt_gas=False)
        worker._step()


def test_a_nan_gradient_skips_the_step_and_the_next_one_trains():
    worker = _engine()
    engine = worker.engine
    weights = lambda: [p.detach().float().clone() for p in engine.module.parameters()]  # noqa: E731
    w0 = weights()
    _update(worker, poison=False)
    w1 = weights()
    assert all(not torch.equal(a, b) for a, b in zip(w0, w1))
    assert 0 < worker.last_grad_norm < float("inf")
    _update(worker, poison=True)
    assert worker.last_grad_norm == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(w1, weights())), "the poisoned step changed the weights"
    _update(worker, poison=False)
    w3 = weights()
    assert all(torch.isfinite(w).all() and not torch.equal(a, w) for a, w in zip(w1, w3))
