"""Training workers: DeepSpeed engines for the policy (actor) and the critic; forward-only
workers for the reference policy and a reward model.

All methods take a *local* batch (see ``rlhf.data.batch``): the driver splits each step's samples
over the data-parallel ranks. ``update`` receives the rows of every optimizer step of the step,
one after another (``optimizer_steps`` blocks of equal size), and the GLOBAL loss denominator of
each block, so that micro-batch losses summed over accumulation and averaged over ranks equal the
whole mini-batch loss (``rlhf.algos.losses.micro_batch_loss``).

Returned statistics are sums with their weights (``{name: (sum, count)}``) so the driver can
combine ranks exactly: token-level stats are weighted by policy tokens.

The critic is ``AutoModelForTokenClassification`` with one label: the checkpoint's backbone and
a new linear head giving one value per position; the value of response token t is read at the
position that predicts it (the state before the action), like the policy's logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rlhf.data.batch import Batch, response_width, select, size
from rlhf.data.packing import TOKEN_KEYS, largest_first, pack, real_lengths, split_to_count, token_groups, unpack
from rlhf.workers.base import Worker
from rlhf.workers.sync_cuda import TrainStates, WeightSource, sender_for

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec
    from rlhf.workers.sync_cuda import CudaIPCSender, NcclSender

Stats = dict[str, tuple[float, float]]


def _ds_config(spec: RunSpec, lr_warmup: int, max_grad_norm: float, world_size: int, optimizer: bool = True) -> dict:
    """DeepSpeed's config for a role of ``world_size`` ranks (the critic, the reference may have
    fewer than the actor: DeepSpeed checks micro × accumulation × ranks = batch)."""
    b = spec.batch
    cfg: dict = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": b.grad_accum,
        "train_batch_size": b.micro_batch_size * b.grad_accum * world_size,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": spec.train.zero_stage},
        "bf16": {"enabled": spec.model.dtype == "bfloat16"},
        "fp16": {"enabled": spec.model.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.train.offload_optimizer and spec.train.zero_stage > 0:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": spec.device == "cuda"}
        # on CPU the "offloaded" optimizer is where it always was: torch's AdamW steps it, and
        # DeepSpeed's CPU Adam (a minute of JIT compilation) is not built
        cfg["zero_force_ds_cpu_optimizer"] = spec.device == "cuda"
    if not optimizer:
        cfg.pop("gradient_clipping")
    return cfg


def _optimizer(spec: RunSpec, params, lr: float):
    """AdamW for the trained parameters. With the optimizer offloaded to host memory on GPU runs,
    DeepSpeed's CPU Adam (vectorised C++, the only optimizer DeepSpeed steps on the host at speed);
    otherwise torch's AdamW (fused on CUDA)."""
    wd = spec.algo.weight_decay
    if spec.device == "cuda" and spec.train.offload_optimizer and spec.train.zero_stage > 0:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=wd, adamw_mode=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=spec.device == "cuda")


def _warmup(optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )


def _to(batch: Batch, device) -> Batch:
    """The batch's tensors on ``device`` (non_blocking: a blocking copy waits for the device's queue to drain);
    other values (a supervised micro-batch's ``max_len``) as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class _Model(Worker):
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
        return model

    def torch_device(self):
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", torch.cuda.current_device())

    def _on_rank0(self, fn):
        """``fn(module)`` on rank 0 with whole parameters (gathered on every rank under ZeRO-3, and
        its tensors then copied out of the gathered buffers), None on the other ranks."""
        module = self.engine.module
        if self.spec.train.zero_stage != 3:
            return fn(module) if self.rank == 0 else None
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return _cloned(fn(module)) if self.rank == 0 else None

    # -- the RL passes run padding-free (rlhf.data.packing): micro-batches of at most
    #    ``train.max_tokens_per_micro_batch`` real tokens, the same number on every rank
    def packed_micro_batches(self, batch: Batch) -> list[tuple[list[int], dict]]:
        """``[(rows, packed)]`` covering the local batch's rows, the micro-batch with the most tokens
        first (``rlhf.data.packing.largest_first``). Where the LM head is
        partitioned (ZeRO-3, several ranks) each ``packed`` also holds ``head_rows``, the most head
        rows any rank has in that micro-batch (``rlhf.workers.zero3.equal_head_rows``), agreed here
        in one collective instead of one per head pass."""
        from rlhf.workers.zero3 import padded_head

        plen, rlen = real_lengths(batch)
        n = (plen + rlen).tolist()
        groups = token_groups(n, self.spec.train.max_tokens_per_micro_batch)
        groups = largest_first(split_to_count(groups, n, self._max_over_ranks(len(groups))), n)
        out = [(rows, pack(batch, rows)) for rows in groups]
        if padded_head(_hf_model(self._fn_module()).get_output_embeddings()):
            most = self._max_each_over_ranks([len((p if rows else self._stand_in(p))["targets"]) for rows, p in out])
            for (_, p), m in zip(out, most):
                p["head_rows"] = m
        return out

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
        from rlhf.workers.zero3 import equal_head_rows

        model = _hf_model(module)
        dev = self.torch_device()
        hidden = self._hidden(model, packed)[packed["pred_index"].to(dev, non_blocking=True)]
        head = model.get_output_embeddings()
        targets = packed["targets"].to(dev, non_blocking=True)
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
        loaded, _ = self.engine.load_checkpoint(str(folder), tag="ds", load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_strict=not self.lora)
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
        return fn(module, _to(mb, self.torch_device()), compile=self.spec.train.compile_logprobs)

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
        return [tuple(_cpu(x) for x in r) if isinstance(r, tuple) else _cpu(r) for r in out]


class TrainedWorker(_Model):
    """A role trained by a DeepSpeed engine with an optimizer (the actor, the critic). Its engine's
    states leave the GPU while vLLM generates in hybrid placement (``states``, a ``TrainStates``;
    the driver's ``rlhf.workers.schedule`` calls the two methods below)."""

    def _initialize(self, model, params, lr: float, warmup_steps: int) -> None:
        """The DeepSpeed engine (AdamW over ``params``, linear warmup) and the states that follow it."""
        import deepspeed

        opt = _optimizer(self.spec, params, lr)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=_warmup(opt, warmup_steps),
            config=_ds_config(self.spec, warmup_steps, self.spec.algo.max_grad_norm, self.world_size),
        )
        self.states = TrainStates(self.engine, self.spec.train.zero_stage)

    def offload_train_states(self) -> dict[str, float]:
        """Parameters, gradients and optimizer states to host memory (hybrid placement on GPU); what
        stays on the GPU, under the role's name (the actor's and the critic's both reach the loop)."""
        import torch

        return {**self.states.offload(),
                f"memory/{self._memory_name()}_resident_gib": torch.cuda.memory_reserved() / 2**30}

    def reload_train_states(self) -> dict[str, float]:
        return self.states.reload()


class PolicyWorker(TrainedWorker):
    """The actor: a causal LM trained with the clipped policy loss (+ KL loss, - entropy bonus).

    On GPU with vLLM it holds the weight ``sender`` (CUDA IPC or NCCL by placement,
    ``rlhf.workers.sync_cuda``), made when the driver connects it to the rollout engines.

    With ``model.lora.rank > 0`` the model is wrapped with LoRA adapters and only they train; the
    weight sync and the HF export carry the merged weights under the base model's names
    (``full_state_dict``, ``gpu_sync_send``), and the HF export also writes the adapter (peft's
    ``save_pretrained``) beside it."""

    sender: Optional[CudaIPCSender | NcclSender] = None

    @property
    def lora(self) -> bool:
        return self.spec.model.lora.rank > 0

    def setup(self) -> None:
        algo = self.spec.algo
        # a reward model run (algo=rm) trains a sequence classifier in the actor's place
        model = self.load("sequence_score" if algo.kind == "rm" else None)
        if self.lora:  # LoRA: frozen weights, trained adapters (rlhf.models.lora); the reference stays the base
            from rlhf.models.lora import apply_lora

            model = apply_lora(model, self.spec.model.lora, self.spec.train.seed,
                               gradient_checkpointing=self.spec.model.gradient_checkpointing)
        from rlhf.models.flops import flop_shape

        self.flops = flop_shape(model)
        self._initialize(model, [p for p in model.parameters() if p.requires_grad], algo.lr, algo.warmup_steps)
        self.temperature = self.spec.rollout.temperature

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """The current policy's log-probs of the response tokens, ``[B, R]`` (0 off the response)."""
        self.engine.eval()
        return self._packed_logprobs(self.engine.module, batch)

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """LoRA: the reference policy is the base model, i.e. this model with its adapters off."""
        module = self.engine.module
        self.engine.eval()
        with module.disable_adapter():
            return self._packed_logprobs(module, batch)

    def update(self, batch: Batch, denominators: list[float]) -> Stats:
        """One or more optimizer steps (see the module doc). Without ``old_logp`` in the batch the
        update is exactly on-policy: the ratio's anchor is this forward's own log-probs, and the
        rollout engine's mismatch is measured against them (``mismatch/*``)."""
        from rlhf.algos.objective import policy_loss_terms

        algo = self.spec.algo
        self.engine.train()
        module = self.engine.module
        n_opt = len(denominators)
        per_step = size(batch) // n_opt
        R = response_width(batch)
        on_policy = "old_logp" not in batch
        stats = _StatSums()
        pg_total, flops = 0.0, 0.0
        steps: list = []  # (mark before, mark after) each optimizer step
        longest = 0  # the largest packed micro-batch, in tokens (what the plan sizes activations for)
        dev = self.torch_device()

        def step(boundary: bool) -> None:  # an optimizer step is timed apart, without waiting for it
            before = _mark(dev)
            self._step()
            if boundary:
                steps.append((before, _mark(dev)))
        t0 = _clock(dev)

        for k in range(n_opt):
            block = select(batch, slice(k * per_step, (k + 1) * per_step))
            packed = self.packed_micro_batches(block)
            for i, (rows, p) in enumerate(packed):
                self.engine.set_gradient_accumulation_boundary(i == len(packed) - 1)
                if not rows:  # a rank with fewer micro-batches than another: zero gradient, same collectives
                    lp, _ = self._token_logprobs(module, self._stand_in(p))
                    self.engine.backward(lp.sum() * 0.0, scale_wrt_gas=False)
                    step(i == len(packed) - 1)
                    continue
                mb = _to({key: block[key][rows] for key in TOKEN_KEYS if key in block}, dev)
                longest = max(longest, int(p["input_ids"].numel()))
                lp, ent = self._token_logprobs(module, p, with_entropy=True)
                logp = unpack(lp, p, len(rows), R)
                ent = unpack(ent, p, len(rows), R)
                terms = policy_loss_terms(algo, logp, ent, mb, denominators[k], self.world_size)
                self.engine.backward(terms.loss, scale_wrt_gas=False)
                step(i == len(packed) - 1)
                pg_total = pg_total + terms.pg_loss.detach().double()  # read once, after the loop
                for name, v in terms.stats.items():
                    stats.add(f"actor/{name}", v, terms.tokens)
                if on_policy and "rollout_logp" in mb:
                    stats.mismatch(logp.detach(), mb["rollout_logp"], mb["response_mask"])
                flops += 3 * self.flops.forward(float(p["input_ids"].numel()), float(len(p["targets"])),
                                                float(p["sq_lengths"]))
            gn = self.last_grad_norm
            if gn is not None:
                stats.add("actor/grad_norm", float(gn), 1.0)
        out = stats.result()
        out["actor/pg_loss"] = (float(pg_total) / n_opt, 1.0 / self.world_size)  # combined: the global loss
        out["actor/lr"] = (self.scheduler.get_last_lr()[0], 1.0)
        seconds = _clock(dev) - t0
        optimizer_s = sum(_between(a, b) for a, b in steps)
        out["perf/update_tflops"] = (flops / max(seconds, 1e-9) / 1e12, 1.0)  # per rank, averaged
        # the same FLOPs over the forward + backward passes alone: what the optimizer step costs apart
        out["perf/fwd_bwd_tflops"] = (flops / max(seconds - optimizer_s, 1e-9) / 1e12, 1.0)
        out["time/actor_optimizer_step"] = (optimizer_s, 1.0)
        out["perf/micro_batch_tokens_max"] = (float(longest), 1.0)
        return out

    def train_step(self, micro_batches: list, objective) -> dict[str, float]:
        """One optimizer step of a supervised loop: ``loss, stats = objective(model, mb)`` on each
        of this rank's micro-batches (exactly ``spec.batch.grad_accum`` of them), backward, step.
        Losses arrive already scaled for the global batch (``mb["loss_scale"]``). Returns the
        summed stats plus ``grad_norm``, ``lr``, the largest micro-batch's real tokens (what its
        padding-free passes run over, as the RL update counts them; ``perf/micro_batch_tokens_max``)
        and, on CUDA, this step's memory peaks (``memory_peaks``: ``memory/*``)."""
        if len(micro_batches) != self.engine.gradient_accumulation_steps():
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches; DeepSpeed accumulates "
                             f"{self.engine.gradient_accumulation_steps()} per optimizer step")
        self.memory_peaks()  # restart the counters: the step's peaks are its own, not an evaluation's or a save's
        self.engine.train()
        module = self.engine.module
        stats = _StatSums()  # the objectives' tensors summed on the device, read once after the loop
        self.last_grad_norm = None
        for mb in micro_batches:
            loss, mb_stats = self._run_fn(objective, module, mb)
            self.engine.backward(loss, scale_wrt_gas=False)
            self._step()
            stats.add_sums(mb_stats)
        sums = stats.totals()
        gn = self.last_grad_norm
        sums["grad_norm"] = float(gn) if gn is not None else float("nan")
        sums["lr"] = float(self.scheduler.get_last_lr()[0])
        # every supervised collate gives the real tokens' places (rlhf.data.sft.padding_free_index)
        sums["perf/micro_batch_tokens_max"] = float(max(mb["real_index"].numel() for mb in micro_batches))
        return {**sums, **self.memory_peaks()}

    def save_hf(self, path: str) -> Optional[str]:
        """Write the model (full weights, gathered under ZeRO-3) and its tokenizer in HF format to
        ``path`` on rank 0, ``from_pretrained``-ready. Returns the path on rank 0, else None.

        LoRA: ``path`` holds the merged model (base architecture, ``W + (alpha/r)·B A``), and
        ``adapter_dir(path)`` the adapter alone (``PeftModel.from_pretrained(base, adapter)``)."""
        from pathlib import Path

        from rlhf.models.lora import merged_state_dict

        # one gather under ZeRO-3 for both: the merged weights and (LoRA) the adapter's own tensors
        states = self._on_rank0(lambda m: (merged_state_dict(m), _own_state_dict(m) if self.lora else None))
        if self.rank != 0:
            return None
        state, raw = states
        from rlhf.models import load_tokenizer

        from rlhf.storage import publish

        out = Path(path)
        module = self.engine.module
        if self.lora:
            from rlhf.models.lora import adapter_dir

            with publish(adapter_dir(out)) as tmp:
                module.save_pretrained(str(tmp), state_dict=raw)
            module = module.get_base_model()  # the HF model; ``state`` has its parameter names
        # written beside and renamed: a run killed mid-export leaves no ``hf`` dir that looks whole
        with publish(out) as tmp:
            module.save_pretrained(str(tmp), state_dict=state)
            load_tokenizer(self.model_path()).save_pretrained(str(tmp))
        return str(out)

    last_grad_norm: Optional[float] = None

    def _step(self) -> None:
        """``engine.step()``; at an accumulation boundary also the step's global gradient norm
        before clipping, into ``last_grad_norm``. DeepSpeed's ZeRO optimizers compute it while
        stepping, so it is read after the step (before, it is the previous step's). A plain torch
        optimizer (ZeRO-0) keeps none: the gradients, which DeepSpeed's backward has already
        averaged over the data-parallel ranks, are summed before the step clears them."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        summed = None
        if boundary and not hasattr(self.engine.optimizer, "_global_grad_norm"):
            norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
            summed = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None
        self.engine.step()
        if boundary:
            gn = self.engine.get_global_grad_norm()
            self.last_grad_norm = float(gn) if gn is not None else summed

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The full weights on rank 0 (gathered under ZeRO-3), None on other ranks: what the
        rollout engines load. A LoRA model gives the base model's names with every adapted weight
        merged (``rlhf.models.lora.merged_state_dict``); the training weights are not touched."""
        from rlhf.models.lora import merged_state_dict

        return self._on_rank0(merged_state_dict)

    # -- GPU weight sync (the driver's side: rlhf.workers.sync.CudaTransport); every rank calls both
    def gpu_sync_setup(self, engines: Sequence[Any]) -> float:
        """This rank's sender for the run's placement, given the rollout engines; seconds to set up."""
        self.sender = sender_for(self.spec, engines, self.rank)
        return self.sender.setup()

    def gpu_sync_send(self, bucket_mb: int = 512) -> dict[str, float]:
        """The current weights to the rollout engines, in buckets of ``bucket_mb``; the sender's figures."""
        from rlhf.models.load import torch_dtype

        return self.sender.send(WeightSource(self.engine.module, bucket_bytes=int(bucket_mb) << 20,
                                             dtype=torch_dtype(self.spec.model.dtype)))


def _cpu(x):
    return x.detach().cpu() if torch.is_tensor(x) else x


def _own_state_dict(module) -> dict[str, torch.Tensor]:
    """The module's own state dict on the CPU (for a LoRA model: peft names, adapters included)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _cloned(x):
    """Tensors (in dicts and tuples) copied, so they outlive ZeRO-3's gathered buffers."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_cloned(v) for v in x)
    return x


def _hf_model(module):
    """The transformers model inside a peft wrapper (whose LoRA layers stay in place)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _mark(device):
    """A point in the device's stream (a CUDA event; on CPU the clock): ``_between`` two marks, read
    once the work is done, needs no wait while it is queued."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    import time

    return time.perf_counter()


def _between(a, b) -> float:
    """Seconds from mark ``a`` to mark ``b`` (CUDA events: after a synchronize)."""
    return a.elapsed_time(b) / 1000.0 if isinstance(a, torch.cuda.Event) else b - a


def _clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    import time

    return time.perf_counter()


class _StatSums:
    """Per-rank sums with their weights (``{name: (sum, weight)}``, see the module doc); names
    ending in ``_max`` carry a maximum, which the driver combines by max. Values and weights may be
    tensors on the GPU: they are summed there and read once, in ``result`` (a read per micro-batch
    would stall the GPU while the host waits)."""

    def __init__(self):
        self.sums: dict[str, Any] = {}
        self.weights: dict[str, Any] = {}

    def add(self, name: str, value: Any, weight: Any) -> None:
        value = value.double() if torch.is_tensor(value) else value
        self.sums[name] = self.sums.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def add_sums(self, sums: dict[str, Any]) -> None:
        """Plain sums (a supervised objective's stats), each added with weight 1; see ``totals``."""
        for name, value in sums.items():
            self.add(name, value, 1.0)

    def totals(self) -> dict[str, float]:
        """The plain sums of ``add_sums``, read once."""
        return {k: s for k, (s, _) in self.result().items()}

    def mismatch(self, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """The rollout engine's sampled-token log-probs against the trainer's, for this micro-batch
        (``rlhf.algos.kl.mismatch_sums``: the sums behind ``logprob_mismatch``)."""
        from rlhf.algos.kl import mismatch_sums

        m = mismatch_sums(rollout_logp, trainer_logp, mask)
        top = torch.as_tensor(self.sums.get("mismatch/logp_abs_max", 0.0), dtype=torch.float64, device=m["max"].device)
        for key, value in (("mismatch/logp_abs_mean", self.sums.get("mismatch/logp_abs_mean", 0.0) + m["abs"]),
                           ("mismatch/kl_k3", self.sums.get("mismatch/kl_k3", 0.0) + m["k3"]),
                           ("mismatch/logp_abs_max", torch.maximum(top, m["max"]))):
            self.sums[key] = value
            self.weights[key] = self.weights.get(key, 0.0) + m["n"]  # the max's: whether any token counted

    def result(self) -> Stats:
        out = {}
        for k, s in self.sums.items():
            w = float(self.weights[k])
            if w == 0 and k.startswith("mismatch/"):  # no policy token compared: nothing measured
                continue
            out[k] = (float(s), 1.0 if k.endswith("_max") else w)
        return out


class CriticWorker(TrainedWorker):
    """PPO's value model, trained with the clipped value loss."""

    kind = "token_value"
    # the HF export (AutoModelForTokenClassification with one label), as the policy's
    save_hf = PolicyWorker.save_hf
    full_state_dict = PolicyWorker.full_state_dict

    def setup(self) -> None:
        critic = self.spec.algo.critic
        model = self.load()
        self._initialize(model, model.parameters(), critic.lr, critic.warmup_steps)

    def _values(self, packed: dict) -> torch.Tensor:
        """Values of a packed micro-batch's response tokens, flat ``[M]``: the head's output at the
        position that predicts each token (the state before the action)."""
        from rlhf.models.varlen import packed_kwargs

        module = self.engine.module
        dev = self.torch_device()
        out = module(**packed_kwargs(packed, dev)).logits[0, :, 0]
        return out[packed["pred_index"].to(dev, non_blocking=True)].float()

    def values(self, batch: Batch) -> torch.Tensor:
        self.engine.eval()
        return self.per_token(batch, self._values)

    def update(self, batch: Batch, denominators: list[float]) -> Stats:
        from rlhf.algos import micro_batch_loss, value_loss

        algo = self.spec.algo
        self.engine.train()
        n_opt = len(denominators)
        per_step = size(batch) // n_opt
        R = response_width(batch)
        dev = self.torch_device()
        total_loss, clipped, n_tok_all = 0.0, 0.0, 0.0
        for k in range(n_opt):
            block = select(batch, slice(k * per_step, (k + 1) * per_step))
            packed = self.packed_micro_batches(block)
            for i, (rows, p) in enumerate(packed):
                self.engine.set_gradient_accumulation_boundary(i == len(packed) - 1)
                if not rows:  # zero gradient, the same collectives as the busier ranks
                    v = self._values(self._stand_in(p))
                    self.engine.backward(v.sum() * 0.0, scale_wrt_gas=False)
                    self.engine.step()
                    continue
                mb = _to({key: block[key][rows] for key in TOKEN_KEYS if key in block}, dev)
                mask = mb["response_mask"]
                v = unpack(self._values(p), p, len(rows), R)
                per_token = value_loss(v, mb["old_values"], mb["returns"], mask, algo.critic.value_clip)
                loss = micro_batch_loss(per_token, mask, algo.loss_agg, denominators[k], self.world_size)
                self.engine.backward(loss, scale_wrt_gas=False)
                self.engine.step()
                with torch.no_grad():  # summed on the device, read once after the loop
                    total_loss = total_loss + loss.detach().double() / self.world_size / n_opt
                    c = ((v - mb["old_values"]).abs() > algo.critic.value_clip).float()
                    clipped = clipped + (c * mask).sum().double()
                    n_tok_all = n_tok_all + mask.sum().double()
        return {
            "critic/value_loss": (float(total_loss), 1.0 / self.world_size),
            "critic/value_clip_frac": (float(clipped), float(n_tok_all)),
            "critic/lr": (self.scheduler.get_last_lr()[0], 1.0),
        }


class ReferenceWorker(_Model):
    """The frozen initial policy: log-probabilities for the KL term (ZeRO-3 sharded if the run is)."""

    def uses_deepspeed(self) -> bool:
        return self.spec.train.zero_stage == 3

    def setup(self) -> None:
        self.module = self._frozen(self.load())
        self.temperature = self.spec.rollout.temperature

    def load_dtype(self) -> str:
        """Frozen models run in the training dtype on GPU (bf16, as the policy's forward does),
        loaded so from the start: half the host and GPU memory of float32, the tensor cores' speed."""
        return self.spec.model.dtype if self.device == "cuda" else "float32"

    def _frozen(self, model):
        model.requires_grad_(False).eval()
        if self.spec.train.zero_stage == 3:
            import deepspeed

            cfg = _ds_config(self.spec, 0, 0.0, self.world_size, optimizer=False)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            return engine
        return model.to(self.torch_device())

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self._packed_logprobs(getattr(self.module, "module", self.module), batch)


class RewardModelWorker(ReferenceWorker):
    """A sequence classifier with one label (reward.model_path): one score per sample, read at
    the last real token of prompt + response."""

    kind = "sequence_score"

    def setup(self) -> None:
        from rlhf.models import model_dir

        path = model_dir(self.spec, "reward")
        self.module = self._frozen(self.load("sequence_score", path))

    @torch.no_grad()
    def scores(self, batch: Batch) -> torch.Tensor:
        """One score per sample, from padding-free micro-batches (as every other RL pass)."""
        module = getattr(self.module, "module", self.module)  # a ZeRO-3 engine wraps it
        out = torch.zeros(size(batch))
        # an empty micro-batch still runs (its one-token stand-in from pack): ZeRO-3's gathers match
        done = [(rows, packed_last_token_scores(module, p, self.torch_device()))
                for rows, p in self.packed_micro_batches(batch)]
        for rows, scores in done:  # read after every pass is queued
            if rows:
                out[rows] = scores.cpu()
        return out


def packed_last_token_scores(model, packed: dict, device) -> torch.Tensor:
    """A sequence classifier's score of each sample of a packed micro-batch (``rlhf.data.packing.pack``),
    ``[n samples]``: the score head at the sample's last real token, the end of its span in
    ``cu_seqlens``. The backbone and the ``score``/``classifier`` head run separately instead of
    the model's own pooling, which finds the last token by ``pad_token_id`` and so skips a final
    EOS whenever the tokenizer pads with EOS. The reward-model loop (rlhf.loops.rm) trains on the
    same position."""
    from rlhf.models.varlen import packed_kwargs

    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no score/classifier head")
    hidden = model.base_model(**packed_kwargs(packed, device)).last_hidden_state[0]
    last = packed["cu_seqlens"][1:].to(device=hidden.device, dtype=torch.long) - 1
    return head(hidden[last]).squeeze(-1).float()
