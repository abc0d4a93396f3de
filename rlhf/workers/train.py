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

import math
from typing import Any, Optional

import torch

from rlhf.data.batch import Batch, response_slice, response_tokens, select, size
from rlhf.workers.base import Worker
from rlhf.workers.sync_cuda import TrainerSyncMixin

Stats = dict[str, tuple[float, float]]


def _ds_config(spec: Any, lr_warmup: int, max_grad_norm: float, optimizer: bool = True) -> dict:
    b = spec.batch
    cfg: dict = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": b.grad_accum,
        "train_batch_size": b.micro_batch_size * b.grad_accum * b.train_world_size,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": spec.train.zero_stage},
        "bf16": {"enabled": spec.model.dtype == "bfloat16"},
        "fp16": {"enabled": spec.model.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.train.offload_optimizer and spec.train.zero_stage > 0:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if not optimizer:
        cfg.pop("gradient_clipping")
    return cfg


def _warmup(optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )


def _forward(module, mb: Batch):
    return module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                  position_ids=mb["position_ids"], use_cache=False)


def _to(batch: Batch, device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


class _Model(Worker):
    """Shared loading: the checkpoint path, the tokenizer ids, the device."""

    kind = "causal_lm"
    lora = False  # the policy's LoRA adapters (PolicyWorker); the critic trains every weight

    def model_path(self) -> str:
        from rlhf.models import model_dir

        return model_dir(self.spec)

    def load(self, kind: Optional[str] = None, path: Optional[str] = None):
        from rlhf.models import load_model, load_tokenizer

        path = path or self.model_path()
        tok = load_tokenizer(path)
        torch.manual_seed(self.spec.train.seed)  # new heads (critic, reward) start identical everywhere
        model = load_model(path, kind or self.kind, "float32", pad_token_id=tok.pad_token_id)
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

    def micro_batches(self, batch: Batch):
        m = self.spec.batch.micro_batch_size
        for s in range(0, size(batch), m):
            yield _to(select(batch, slice(s, s + m)), self.torch_device())

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
    #    ``fn(model, micro_batch)`` (see rlhf.loops.objectives); micro-batches are made by the driver.
    def _fn_module(self):
        engine = getattr(self, "engine", None) or self.module
        return getattr(engine, "module", engine)

    @torch.no_grad()
    def apply(self, micro_batches: list, fn) -> list:
        """``fn(model, mb)`` on each micro-batch without gradients, in eval mode (evaluation,
        reference log-probs). Tensors in the results come back on the CPU."""
        module = self._fn_module()
        was_training = module.training
        module.eval()
        out = []
        for mb in micro_batches:
            r = fn(module, _to(mb, self.torch_device()))
            if isinstance(r, tuple):
                r = tuple(x.detach().cpu() if torch.is_tensor(x) else x for x in r)
            elif torch.is_tensor(r):
                r = r.detach().cpu()
            out.append(r)
        module.train(was_training)
        return out


class PolicyWorker(TrainerSyncMixin, _Model):
    """The actor: a causal LM trained with the clipped policy loss (+ KL loss, - entropy bonus).

    With ``model.lora.rank > 0`` the model is wrapped with LoRA adapters and only they train; the
    weight sync and the HF export carry the merged weights under the base model's names
    (``full_state_dict``, ``TrainerSyncMixin.gpu_sync_send``), and the HF export also writes the
    adapter (peft's ``save_pretrained``) beside it."""

    @property
    def lora(self) -> bool:
        return self.spec.model.lora.rank > 0

    def setup(self) -> None:
        import deepspeed

        algo = self.spec.algo
        # a reward model run (algo=rm) trains a sequence classifier in the actor's place
        model = self.load("sequence_score" if algo.kind == "rm" else None)
        if self.lora:  # LoRA: frozen weights, trained adapters (rlhf.models.lora); the reference stays the base
            from rlhf.models.lora import apply_lora

            model = apply_lora(model, self.spec.model.lora, self.spec.train.seed,
                               gradient_checkpointing=self.spec.model.gradient_checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=algo.lr, weight_decay=algo.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=_warmup(opt, algo.warmup_steps),
            config=_ds_config(self.spec, algo.warmup_steps, algo.max_grad_norm),
        )
        self.temperature = self.spec.rollout.temperature

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        from rlhf.algos import token_logprobs

        self.engine.eval()
        out = []
        for mb in self.micro_batches(batch):
            logits = _forward(self.engine, mb).logits[:, response_slice(mb)]
            out.append(token_logprobs(logits, response_tokens(mb), self.temperature).cpu())
        return torch.cat(out)

    def update(self, batch: Batch, denominators: list[float]) -> Stats:
        from rlhf.algos import entropy_from_logits, kl_penalty, micro_batch_loss, policy_loss, token_logprobs

        algo, b = self.spec.algo, self.spec.batch
        self.engine.train()
        n_opt = len(denominators)
        per_step = size(batch) // n_opt
        kl_loss = algo.kl.coef > 0 and algo.kl.placement == "loss" and "ref_logp" in batch
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        pg_total = 0.0

        def add(name: str, value: float, weight: float) -> None:
            sums[name] = sums.get(name, 0.0) + value * weight
            counts[name] = counts.get(name, 0.0) + weight

        for k in range(n_opt):
            block = select(batch, slice(k * per_step, (k + 1) * per_step))
            for mb in self.micro_batches(block):
                mask = mb["response_mask"]
                n_tok = float(mask.sum())
                logits = _forward(self.engine, mb).logits[:, response_slice(mb)]
                logp = token_logprobs(logits, response_tokens(mb), self.temperature)
                old = mb["old_logp"] if "old_logp" in mb else logp.detach()
                per_token, st = policy_loss(
                    logp, old, mb["advantages"], mask,
                    clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                    ratio_level=algo.ratio_level,
                    rollout_logp=mb.get("rollout_logp") if algo.tis_cap is not None else None,
                    tis_cap=algo.tis_cap,
                )
                total = per_token
                if algo.entropy_coef > 0:
                    ent = entropy_from_logits(logits / self.temperature)
                    total = total - algo.entropy_coef * ent
                else:
                    with torch.no_grad():
                        ent = entropy_from_logits(logits.detach() / self.temperature)
                if kl_loss:
                    kl = kl_penalty(logp, mb["ref_logp"], algo.kl.estimator, algo.kl.clamp, mask)
                    total = total + algo.kl.coef * kl
                    add("actor/kl_loss", float((kl.detach() * mask).sum()) / max(n_tok, 1), n_tok)
                loss = micro_batch_loss(total, mask, algo.loss_agg, denominators[k], self.world_size)
                self.engine.backward(loss, scale_wrt_gas=False)
                if self.engine.is_gradient_accumulation_boundary():
                    self.last_grad_norm = self._grad_norm()
                self.engine.step()
                # this micro-batch's share of the optimizer step's global loss
                pg_total += float(micro_batch_loss(per_token.detach(), mask, algo.loss_agg, denominators[k], 1))
                for name, v in st.items():
                    add(f"actor/{name}", float(v), n_tok)
                add("actor/entropy", float((ent.detach() * mask).sum()) / max(n_tok, 1), n_tok)
            gn = self.last_grad_norm
            if gn is not None:
                add("actor/grad_norm", float(gn), 1.0)
        out = {k: (sums[k], counts[k]) for k in sums}
        out["actor/pg_loss"] = (pg_total / n_opt, 1.0 / self.world_size)  # combined: the global loss
        out["actor/lr"] = (self.scheduler.get_last_lr()[0], 1.0)
        return out

    def train_step(self, micro_batches: list, objective) -> dict[str, float]:
        """One optimizer step of a supervised loop: ``loss, stats = objective(model, mb)`` on each
        of this rank's micro-batches (exactly ``spec.batch.grad_accum`` of them), backward, step.
        Losses arrive already scaled for the global batch (``mb["loss_scale"]``). Returns the
        summed stats plus ``grad_norm`` and ``lr``."""
        if len(micro_batches) != self.engine.gradient_accumulation_steps():
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches; DeepSpeed accumulates "
                             f"{self.engine.gradient_accumulation_steps()} per optimizer step")
        self.engine.train()
        module = self.engine.module
        sums: dict[str, float] = {}
        gn = None
        for mb in micro_batches:
            loss, stats = objective(module, _to(mb, self.torch_device()))
            self.engine.backward(loss, scale_wrt_gas=False)
            if self.engine.is_gradient_accumulation_boundary():
                gn = self._grad_norm()
            self.engine.step()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        sums["grad_norm"] = float(gn) if gn is not None else float("nan")
        sums["lr"] = float(self.scheduler.get_last_lr()[0])
        return sums

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

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        module = self.engine.module
        if self.lora:
            from rlhf.models.lora import adapter_dir

            module.save_pretrained(str(adapter_dir(out)), state_dict=raw)
            module = module.get_base_model()  # the HF model; ``state`` has its parameter names
        module.save_pretrained(str(out), state_dict=state)
        load_tokenizer(self.model_path()).save_pretrained(str(out))
        return str(out)

    last_grad_norm: Optional[float] = None

    def _grad_norm(self) -> Optional[float]:
        """Global gradient norm before clipping (DeepSpeed's own is only kept in some modes)."""
        gn = self.engine.get_global_grad_norm()
        if gn is not None:
            return float(gn)
        if self.spec.train.zero_stage >= 2:
            return None  # gradients are partitioned; DeepSpeed reports the norm where it has it
        # ZeRO 0/1: at the boundary DeepSpeed's backward has already averaged the gradients over
        # the DP ranks, so this is the norm of the global gradient on every rank
        sq = torch.zeros(())
        for p in self.engine.module.parameters():
            if p.grad is not None:
                sq += p.grad.detach().float().pow(2).sum().cpu()
        return float(sq.sqrt())

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The full weights on rank 0 (gathered under ZeRO-3), None on other ranks: what the
        rollout engines load. A LoRA model gives the base model's names with every adapted weight
        merged (``rlhf.models.lora.merged_state_dict``); the training weights are not touched."""
        from rlhf.models.lora import merged_state_dict

        return self._on_rank0(merged_state_dict)


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


class CriticWorker(_Model):
    """PPO's value model, trained with the clipped value loss."""

    kind = "token_value"
    # the HF export (AutoModelForTokenClassification with one label), as the policy's
    save_hf = PolicyWorker.save_hf
    full_state_dict = PolicyWorker.full_state_dict

    def setup(self) -> None:
        import deepspeed

        critic = self.spec.algo.critic
        model = self.load()
        opt = torch.optim.AdamW(model.parameters(), lr=critic.lr, weight_decay=self.spec.algo.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=_warmup(opt, critic.warmup_steps),
            config=_ds_config(self.spec, critic.warmup_steps, self.spec.algo.max_grad_norm),
        )

    def _values(self, mb: Batch) -> torch.Tensor:
        return _forward(self.engine, mb).logits[:, response_slice(mb), 0].float()

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        self.engine.eval()
        return torch.cat([self._values(mb).cpu() for mb in self.micro_batches(batch)])

    def update(self, batch: Batch, denominators: list[float]) -> Stats:
        from rlhf.algos import micro_batch_loss, value_loss

        algo = self.spec.algo
        self.engine.train()
        n_opt = len(denominators)
        per_step = size(batch) // n_opt
        total_loss, clipped, n_tok_all = 0.0, 0.0, 0.0
        for k in range(n_opt):
            block = select(batch, slice(k * per_step, (k + 1) * per_step))
            for mb in self.micro_batches(block):
                mask = mb["response_mask"]
                v = self._values(mb)
                per_token = value_loss(v, mb["old_values"], mb["returns"], mask, algo.critic.value_clip)
                loss = micro_batch_loss(per_token, mask, algo.loss_agg, denominators[k], self.world_size)
                self.engine.backward(loss, scale_wrt_gas=False)
                self.engine.step()
                total_loss += float(loss.detach()) / self.world_size / n_opt
                with torch.no_grad():
                    c = ((v - mb["old_values"]).abs() > algo.critic.value_clip).float()
                    clipped += float((c * mask).sum())
                    n_tok_all += float(mask.sum())
        return {
            "critic/value_loss": (total_loss, 1.0 / self.world_size),
            "critic/value_clip_frac": (clipped, n_tok_all),
            "critic/lr": (self.scheduler.get_last_lr()[0], 1.0),
        }


class ReferenceWorker(_Model):
    """The frozen initial policy: log-probabilities for the KL term (ZeRO-3 sharded if the run is)."""

    def uses_deepspeed(self) -> bool:
        return self.spec.train.zero_stage == 3

    def setup(self) -> None:
        self.module = self._frozen(self.load())
        self.temperature = self.spec.rollout.temperature

    def _frozen(self, model):
        model.requires_grad_(False).eval()
        if self.spec.train.zero_stage == 3:
            import deepspeed

            cfg = _ds_config(self.spec, 0, 0.0, optimizer=False)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            return engine
        return model.to(self.torch_device())

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        from rlhf.algos import token_logprobs

        out = []
        for mb in self.micro_batches(batch):
            logits = _forward(self.module, mb).logits[:, response_slice(mb)]
            out.append(token_logprobs(logits, response_tokens(mb), self.temperature).cpu())
        return torch.cat(out)


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
        module = getattr(self.module, "module", self.module)  # a ZeRO-3 engine wraps it
        return torch.cat([last_token_scores(module, mb).cpu() for mb in self.micro_batches(batch)])


def last_token_scores(model, mb: Batch) -> torch.Tensor:
    """A sequence classifier's score at each row's last real token (by ``attention_mask``), ``[B]``.

    The backbone and the ``score``/``classifier`` head run separately instead of the model's own
    pooling, which finds the last token by ``pad_token_id`` and so skips a final EOS whenever the
    tokenizer pads with EOS. The reward-model loop (rlhf.loops.rm) trains on the same position."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no score/classifier head")
    hidden = _forward(model.base_model, mb).last_hidden_state
    values = head(hidden).squeeze(-1).float()  # [B, T]
    attn = mb["attention_mask"]
    last = attn.shape[1] - 1 - attn.flip(-1).argmax(-1)
    return values[torch.arange(values.shape[0], device=values.device), last]
