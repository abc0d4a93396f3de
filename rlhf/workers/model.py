"""A model on one rank, what every training-side role shares (``rlhf.workers.policy``,
``critic``, ``frozen``): loading, the padding-free passes of RL (packed micro-batches, log-probs
from the hidden states, per-token values back in the padded layout), the supervised loops'
``fn(model, micro_batch)`` calls, and the DeepSpeed checkpoint state.

All methods take a *local* batch (see ``rlhf.data.batch``): the driver splits each step's samples
over the data-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from rlhf.data.batch import Batch, response_width, size
from rlhf.data.packing import largest_first, pack, real_lengths, split_to_count, token_groups, unpack
from rlhf.workers.base import Worker

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec


def optimizer_checks_its_step(spec: RunSpec) -> bool:
    """Whether the fused AdamW itself takes the global gradient norm, clips to it and skips a step whose
    gradients are not finite (``rlhf.workers.trained.StepChecks``, given ``found_inf`` as under AMP's
    GradScaler), with DeepSpeed's own norm, clipping and bf16 overflow check off: on CUDA at ZeRO-1/2
    with the optimizer on the GPU. DeepSpeed's check tests every gradient tensor apart (six small kernels
    each) and then waits for the GPU (``.item()``) in the middle of its step, so the step's remaining
    kernels are launched with the GPU idle (BENCHMARKS §12: 4,801 kernels, 85 % idle); its norm is a
    float64 copy and a norm per tensor (580 more kernels). The optimizer's checks are one norm over its
    flat partition, on the device."""
    t = spec.train
    return spec.device == "cuda" and spec.model.dtype == "bfloat16" and t.zero_stage in (1, 2) \
        and not t.offload_optimizer


def ds_config(spec: RunSpec, lr_warmup: int, max_grad_norm: float, world_size: int, optimizer: bool = True) -> dict:
    """DeepSpeed's config for a role of ``world_size`` ranks (the critic, the reference may have
    fewer than the actor: DeepSpeed checks micro × accumulation × ranks = batch)."""
    b = spec.batch
    own_checks = optimizer and optimizer_checks_its_step(spec)  # the optimizer clips, not DeepSpeed
    cfg: dict = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": b.grad_accum,
        "train_batch_size": b.micro_batch_size * b.grad_accum * world_size,
        "gradient_clipping": 0.0 if own_checks else max_grad_norm,
        "zero_optimization": {"stage": spec.train.zero_stage},
        "bf16": {"enabled": spec.model.dtype == "bfloat16", "check_grad_overflow": not own_checks},
        "fp16": {"enabled": spec.model.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if own_checks:
        cfg["zero_optimization"]["compute_grad_norm"] = False
    if spec.train.offload_optimizer and spec.train.zero_stage > 0:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": spec.device == "cuda"}
        # on CPU the "offloaded" optimizer is where it always was: torch's AdamW steps it, and
        # DeepSpeed's CPU Adam (a minute of JIT compilation) is not built
        cfg["zero_force_ds_cpu_optimizer"] = spec.device == "cuda"
    if not optimizer:
        cfg.pop("gradient_clipping")
    return cfg


def load_engine_checkpoint(engine, folder, strict: bool = True) -> Optional[str]:
    """DeepSpeed's ``load_checkpoint`` of the weights, optimizer and scheduler saved under ``folder``
    (tag ``ds``); the loaded path, None if there is none. The run keeps its own gradient clipping:
    DeepSpeed's ZeRO-1/2 optimizer would take the checkpoint's (``clip_grad``), and refuses a checkpoint
    saved with its clipping on where its norm is off (``optimizer_checks_its_step``: the fused AdamW clips
    instead), e.g. one written before that change or with the optimizer offloaded."""
    opt = getattr(engine, "optimizer", None)
    clip = getattr(opt, "clip_grad", None)
    own_norm = getattr(opt, "compute_grad_norm", True) is False
    if own_norm:
        opt.compute_grad_norm = True
    try:
        loaded, _ = engine.load_checkpoint(str(folder), tag="ds", load_optimizer_states=True,
                                           load_lr_scheduler_states=True, load_module_strict=strict)
    finally:
        if own_norm:
            opt.compute_grad_norm = False
        if clip is not None:
            opt.clip_grad = clip
    return loaded


def to_device(batch: Batch, device) -> Batch:
    """The batch's tensors on ``device`` (non_blocking: a blocking copy waits for the device's queue to drain);
    other values (a supervised micro-batch's ``max_len``) as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class ModelWorker(Worker):
    """Shared loading: the checkpoint path, the tokenizer ids, the device."""

    kind = "causal_lm"
    lora = False  # the policy's LoRA adapters (PolicyWorker); the critic trains every weight

    def __init__(self, spec: RunSpec, role: str, rank: int, world_size: int):
        super().__init__(spec, role, rank, world_size)
        if self.device == "cuda" and spec.train.expandable_segments:
            from rlhf.workers.allocator import set_expandable_segments

            set_expandable_segments(True)  # before this process allocates anything on the GPU

    def model_path(self) -> str:
        from rlhf.models import model_dir

        return model_dir(self.spec)

    # trained models load in float32 (DeepSpeed keeps float32 master weights from them)
    def load_dtype(self) -> str:
        return "float32"

    def load(self, kind: Optional[str] = None, path: Optional[str] = None):
        from rlhf.models import load_model, load_tokenizer

        path = path or self.model_path()
        tok = load_tokenizer(path)
        torch.manual_seed(self.spec.train.seed)  # new heads (critic, reward) start identical everywhere
        model = load_model(path, kind or self.kind, self.load_dtype(), pad_token_id=tok.pad_token_id)
        # no dropout anywhere (a token-classification head has 0.1 by default): log-probs and values
        # must be one function of the weights, the same on every rank and in every pass
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        if self.spec.model.liger_kernels:
            from rlhf.models.load import apply_liger
            from rlhf.plan.auto import chosen

            apply_liger(model, required=not chosen(self.spec, "model.liger_kernels"))
        from rlhf.models.varlen import use_varlen

        use_varlen(model)  # packed RL passes attend within each sample; padded calls are unchanged
        if self.spec.model.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        if self.spec.model.compile_layers:  # after varlen (traced with the layer), before DeepSpeed wraps it
            from rlhf.models.compiled import backend_for, compile_layers

            compile_layers(model, backend=backend_for(self.device))
        return model

    def torch_device(self):
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", torch.cuda.current_device())

    def on_rank0(self, fn):
        """``fn(module)`` on rank 0 with whole parameters (gathered on every rank under ZeRO-3, and
        its tensors then copied out of the gathered buffers), None on the other ranks."""
        module = self.engine.module
        if self.spec.train.zero_stage != 3:
            return fn(module) if self.rank == 0 else None
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return cloned(fn(module)) if self.rank == 0 else None

    # -- the RL passes run padding-free (rlhf.data.packing): micro-batches of at most
    #    ``train.max_tokens_per_micro_batch`` real tokens, the same number on every rank
    def packed_micro_batches(self, batch: Batch) -> list[tuple[list[int], dict]]:
        """``[(rows, packed)]`` covering the local batch's rows, the micro-batch with the most tokens
        first (``rlhf.data.packing.largest_first``). Where the LM head is
        partitioned (ZeRO-3, several ranks) each ``packed`` also holds ``head_rows``, the most head
        rows any rank has in that micro-batch (``rlhf.workers.zero3.equal_head_rows``), agreed here
        in one collective instead of one per head pass."""
        plen, rlen = real_lengths(batch)
        n = (plen + rlen).tolist()
        groups = token_groups(n, self.spec.train.max_tokens_per_micro_batch)
        groups = largest_first(split_to_count(groups, n, self._max_over_ranks(len(groups))), n)
        out = [(rows, pack(batch, rows)) for rows in groups]
        if self._pads_head():
            most = self._max_each_over_ranks([len((p if rows else self._stand_in(p))["targets"]) for rows, p in out])
            for (_, p), m in zip(out, most):
                p["head_rows"] = m
        return out

    _head_padded: Optional[bool] = None

    def _pads_head(self) -> bool:
        """Whether every rank must call the LM head as many times (``rlhf.workers.zero3.padded_head``:
        a ZeRO-3 head over several ranks). Asked once: the head's partitioning is set with the model."""
        if self._head_padded is None:
            from rlhf.workers.zero3 import padded_head

            self._head_padded = padded_head(hf_model(self._fn_module()).get_output_embeddings())
        return self._head_padded

    def _max_over_ranks(self, value: int) -> int:
        return self._max_each_over_ranks([value])[0]

    def _max_each_over_ranks(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` (the same length on every rank) over the ranks."""
        if self.world_size == 1 or not values:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, device=self.torch_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    @staticmethod
    def _stand_in(packed: dict) -> dict:
        """An empty micro-batch (a rank with fewer than the others) as a one-token pass: every rank
        runs the same forwards, and under ZeRO-3 the same parameter gathers; its result is dropped."""
        one = torch.zeros(1, dtype=torch.long)
        return dict(packed, pred_index=one, targets=one)

    def _hidden(self, model, packed: dict) -> torch.Tensor:
        """The backbone's last hidden states of a packed micro-batch, ``[L, h]``."""
        from rlhf.models.varlen import packed_kwargs

        return model.base_model(**packed_kwargs(packed, self.torch_device())).last_hidden_state[0]

    def _token_logprobs(self, module, packed: dict, with_entropy: bool = False):
        """Log-probs (and entropy) of a packed micro-batch's response tokens, flat ``[M]``,
        from the hidden states (rlhf.algos.logprobs_from_hidden: no [B, T, V] logits)."""
        from rlhf.algos import logprobs_from_hidden

        model = hf_model(module)
        dev = self.torch_device()
        hidden = self._hidden(model, packed)[packed["pred_index"].to(dev, non_blocking=True)]
        head = model.get_output_embeddings()
        targets = packed["targets"].to(dev, non_blocking=True)
        n = hidden.shape[0]
        if self._pads_head():
            from rlhf.workers.zero3 import equal_head_rows

            hidden, targets, n = equal_head_rows(hidden, targets, head, packed.get("head_rows"))
        lp, ent = logprobs_from_hidden(hidden, head, targets, self.temperature, with_entropy,
                                       vocab=model.config.vocab_size, compile=self.spec.train.compile_logprobs)
        return lp[:n], (ent[:n] if ent is not None else None)

    @torch.no_grad()
    def per_token(self, batch: Batch, fn) -> torch.Tensor:
        """``fn(packed)`` (flat ``[M]`` values of a packed micro-batch's response tokens) over the
        whole local batch, back in the padded layout ``[B, R]`` on the CPU (0 off the response)."""
        R = response_width(batch)
        out = torch.zeros(size(batch), R)
        done = [(rows, p, fn(p if rows else self._stand_in(p)).float()) for rows, p in self.packed_micro_batches(batch)]
        for rows, p, flat in done:  # to the host after every pass is queued: no wait between passes
            if rows:
                out[rows] = unpack(flat.cpu(), p, len(rows), R)
        return out

    def _packed_logprobs(self, module, batch: Batch) -> torch.Tensor:
        return self.per_token(batch, lambda p: self._token_logprobs(module, p)[0])

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """The model's log-probs of the response tokens, ``[B, R]`` (0 off the response), in eval
        mode: the policy's before its update (``old_logp``), the reference's, the teacher's."""
        module = self._fn_module()
        (getattr(self, "engine", None) or module).eval()  # a DeepSpeed engine's mode is its module's
        return self._packed_logprobs(module, batch)

    # -- checkpoints (rlhf.ckpt.training): the DeepSpeed state (weights, optimizer, scheduler) and
    #    this process's RNG under <checkpoint dir>/<role>/; every rank calls (the save is collective)
    def save_state(self, path: str) -> None:
        from pathlib import Path

        from rlhf.ckpt.state import rng_state

        folder = Path(path) / self.role
        folder.mkdir(parents=True, exist_ok=True)
        # LoRA: the frozen base weights come from the model path again; the adapters and Adam are saved
        self.engine.save_checkpoint(str(folder), tag="ds", exclude_frozen_parameters=self.lora)
        torch.save(rng_state(), folder / f"rng_rank{self.rank}.pt")

    def load_state(self, path: str) -> None:
        from pathlib import Path

        from rlhf.ckpt.state import set_rng_state

        folder = Path(path) / self.role
        loaded = load_engine_checkpoint(self.engine, folder, strict=not self.lora)
        if loaded is None:
            raise RuntimeError(f"no DeepSpeed checkpoint of {self.role} in {folder}")
        set_rng_state(torch.load(folder / f"rng_rank{self.rank}.pt", weights_only=False))

    # -- supervised loops (rlhf.loops.sft / rm / dpo): the loss comes with the call, as
    #    ``fn(model, micro_batch, compile=...)`` (see rlhf.algos.offline); micro-batches are made by the driver.
    def _fn_module(self):
        engine = getattr(self, "engine", None) or self.module
        return getattr(engine, "module", engine)

    def _run_fn(self, fn, module, mb: dict):
        """``fn(module, mb)`` on this worker's device, with the settings that come from the spec here."""
        return fn(module, to_device(mb, self.torch_device()), compile=self.spec.train.compile_logprobs)

    @torch.no_grad()
    def apply(self, micro_batches: list, fn) -> list:
        """``fn(model, mb)`` on each micro-batch without gradients, in eval mode (evaluation,
        reference log-probs). Tensors in the results come back on the CPU."""
        module = self._fn_module()
        was_training = module.training
        module.eval()
        out = [self._run_fn(fn, module, mb) for mb in micro_batches]
        module.train(was_training)
        # to the CPU after the last micro-batch: a copy per micro-batch would make the host wait for each
        return [tuple(to_cpu(x) for x in r) if isinstance(r, tuple) else to_cpu(r) for r in out]


def to_cpu(x):
    return x.detach().cpu() if torch.is_tensor(x) else x


def cloned(x):
    """Tensors (in dicts and tuples) copied, so they outlive ZeRO-3's gathered buffers."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, dict):
        return {k: cloned(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(cloned(v) for v in x)
    return x


def hf_model(module):
    """The transformers model inside a peft wrapper (whose LoRA layers stay in place)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module
