"""A role trained by a DeepSpeed engine with an optimizer (the actor, the critic): the engine
(AdamW, linear warmup), the optimizer step and its gradient norm, the states that leave the GPU
while vLLM generates, and the trained weights for the rollout engines and the HF export
(``rlhf.workers.export``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from rlhf.workers import export
from rlhf.workers.model import ModelWorker, ds_config, hf_model, optimizer_checks_its_step
from rlhf.workers.sync_cuda import TrainStates

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec

# an update's statistics: sums with their weights, so the driver combines ranks exactly
# (token-level statistics are weighted by policy tokens)
Stats = dict[str, tuple[float, float]]


def _optimizer(spec: RunSpec, params, lr: float):
    """AdamW for the trained parameters. With the optimizer offloaded to host memory on GPU runs,
    DeepSpeed's CPU Adam (vectorised C++, the only optimizer DeepSpeed steps on the host at speed);
    otherwise torch's AdamW (fused on CUDA; at ZeRO-1/2 there it takes the gradient norm, clips and
    skips a step whose gradients are not finite itself: ``StepChecks``)."""
    wd = spec.algo.weight_decay
    if spec.device == "cuda" and spec.train.offload_optimizer and spec.train.zero_stage > 0:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=wd, adamw_mode=True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=spec.device == "cuda")
    if optimizer_checks_its_step(spec):
        opt.register_step_pre_hook(StepChecks(spec.algo.max_grad_norm))
    return opt


class StepChecks:
    """A step pre-hook of torch's fused AdamW doing, on the device and without waiting for it, what
    DeepSpeed's ZeRO-1/2 step does before the update where ``ds_config`` turns that off
    (``rlhf.workers.model.optimizer_checks_its_step``):

    * ``optimizer.grad_norm`` = ‖g‖₂ over every rank's gradients. Under ZeRO-1/2 DeepSpeed hands the
      optimizer one flat fp32 partition per group, disjoint across ranks: ‖g‖² is the sum of the
      ranks' partition norms², one all-reduce of a scalar.
    * clipping to ``max_norm``: g ← g · min(1, max_norm / (‖g‖ + 1e-6)) (``torch.nn.utils.clip_grad_norm_``'s
      rule; DeepSpeed's is the same up to rounding).
    * ``optimizer.found_inf`` = 1 where ‖g‖ is not finite (an inf or a NaN in any rank's gradients):
      the fused kernel then leaves every parameter, moment and step count as they were, as it does
      for AMP's GradScaler, on every rank together.

    DeepSpeed steps the optimizer one parameter group at a time, so the norm is over the group being
    stepped: the global norm because ``_optimizer`` makes one group."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm

    def __call__(self, optimizer, args, kwargs) -> None:
        import torch.distributed as dist

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            optimizer.found_inf = optimizer.grad_norm = None
            return
        with_grad = [p for p in params if p.grad is not None]
        squared = torch.zeros((), device=params[0].device)  # a rank without gradients still joins the sum
        if with_grad:
            squared = torch.nn.utils.get_total_norm([p.grad for p in with_grad]).float().square()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM)
        norm = squared.sqrt()
        if self.max_norm > 0 and with_grad:
            torch.nn.utils.clip_grads_with_norm_(with_grad, self.max_norm, norm)
        optimizer.grad_norm = norm
        optimizer.found_inf = (~torch.isfinite(norm)).float()


def _warmup(optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )


class TrainedWorker(ModelWorker):
    """A role trained by a DeepSpeed engine with an optimizer (the actor, the critic). Its engine's
    states leave the GPU while vLLM generates in hybrid placement (``states``, a ``TrainStates``;
    the driver's ``rlhf.workers.schedule`` calls the two methods below)."""

    def _initialize(self, model, params, lr: float, warmup_steps: int) -> None:
        """The DeepSpeed engine (AdamW over ``params``, linear warmup) and the states that follow it."""
        import deepspeed

        if self.spec.model.compile_layers and self.spec.train.zero_stage < 3:
            # the compiled backward is built at the first backward, where its failure cannot be caught:
            # build it now, on a copy of a layer in the dtype DeepSpeed will train in (ds_config's
            # bf16/fp16 switch follow model.dtype); eager layers if it fails
            from rlhf.models.compiled import backend_for, warm_up
            from rlhf.models.load import torch_dtype

            warm_up(model, self.torch_device(), torch_dtype(self.spec.model.dtype), backend_for(self.device))

        opt = self._adamw = _optimizer(self.spec, params, lr)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=_warmup(opt, warmup_steps),
            config=ds_config(self.spec, warmup_steps, self.spec.algo.max_grad_norm, self.world_size),
        )
        if self.world_size == 1 and self.spec.train.zero_stage == 0:
            # one rank: DeepSpeed's gradient all-reduce would flatten every gradient, reduce it over a
            # group of one and copy it back, an exact no-op that costs a copy of the gradients per step
            self.engine.enable_backward_allreduce = False
        self.states = TrainStates(self.engine, self.spec.train.zero_stage)

    def offload_train_states(self) -> dict[str, float]:
        """Parameters, gradients and optimizer states to host memory (hybrid placement on GPU); what
        stays on the GPU, under the role's name (the actor's and the critic's both reach the loop)."""
        import torch

        return {**self.states.offload(),
                f"memory/{self._memory_name()}_resident_gib": torch.cuda.memory_reserved() / 2**30}

    def reload_train_states(self) -> dict[str, float]:
        return self.states.reload()

    last_grad_norm: Optional[float] = None
    _adamw = None  # the torch optimizer inside DeepSpeed's (StepChecks leaves its norm there)

    def _step(self) -> None:
        """``engine.step()``; at an accumulation boundary also the step's global gradient norm
        before clipping, into ``last_grad_norm``. DeepSpeed's ZeRO optimizers (or the fused AdamW's
        ``StepChecks`` in their place) compute it while stepping, so it is read after the step
        (before, it is the previous step's); a skipped step's is inf. A plain torch
        optimizer (ZeRO-0) keeps none: the gradients, which DeepSpeed's backward has already
        averaged over the data-parallel ranks, are summed before the step clears them."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        summed = None
        if boundary and not hasattr(self.engine.optimizer, "_global_grad_norm"):
            norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
            summed = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None
        self.engine.step()
        if not boundary:
            return
        gn = self.engine.get_global_grad_norm()
        own = getattr(self._adamw, "grad_norm", None)
        if gn is not None:  # DeepSpeed's ZeRO masks a non-finite norm as -1 (its step skipped)
            norm = float(gn)
            self.last_grad_norm = norm if norm >= 0 else float("inf")
        elif own is not None:  # StepChecks' norm, where DeepSpeed's is off: a non-finite one skipped the step
            norm = float(own)
            self.last_grad_norm = norm if math.isfinite(norm) else float("inf")
        else:
            self.last_grad_norm = summed

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The full weights on rank 0 (gathered under ZeRO-3), on the CPU, None on other ranks: what
        the rollout engines load. A LoRA model gives the base model's names with every adapted
        weight merged (``rlhf.models.lora.merged_state_dict``); the training weights are not touched."""
        return self.on_rank0(_full_weights)

    def save_hf(self, path: str) -> Optional[str]:
        """The model (full weights, gathered under ZeRO-3) and its tokenizer in HF format at ``path``
        on rank 0 (``rlhf.workers.export.save_hf``); the path on rank 0, else None."""
        return export.save_hf(self, path)


def _full_weights(module) -> dict[str, torch.Tensor]:
    if hf_model(module) is not module:  # a peft wrapper: LoRA adapters to merge
        from rlhf.models.lora import merged_state_dict

        return merged_state_dict(module)
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}
