"""The policy worker (the actor): the RL update and the supervised loops' optimizer step.

All methods take a *local* batch (see ``rlhf.data.batch``): the driver splits each step's samples
over the data-parallel ranks. ``update`` receives the rows of every optimizer step of the step,
one after another (``optimizer_steps`` blocks of equal size), and the GLOBAL loss denominator of
each block, so that micro-batch losses summed over accumulation and averaged over ranks equal the
whole mini-batch loss (``rlhf.algos.losses.micro_batch_loss``).

Returned statistics are sums with their weights (``{name: (sum, count)}``) so the driver can
combine ranks exactly: token-level stats are weighted by policy tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rlhf.data.batch import Batch, response_width, select, size
from rlhf.data.packing import TOKEN_KEYS, unpack
from rlhf.models.compiled import graphs_compiled
from rlhf.workers.model import to_device
from rlhf.workers.sync_cuda import WeightSource, sender_for
from rlhf.workers.trained import Stats, TrainedWorker

if TYPE_CHECKING:
    from rlhf.algos.objective import Objective
    from rlhf.workers.sync_cuda import CudaIPCSender, NcclSender


class PolicyWorker(TrainedWorker):
    """The actor: a causal LM trained with the clipped policy loss (+ KL loss, - entropy bonus).

    On GPU with vLLM it holds the weight ``sender`` (CUDA IPC or NCCL by placement,
    ``rlhf.workers.sync_cuda``), made when the driver connects it to the rollout engines.

    With ``model.lora.rank > 0`` the model is wrapped with LoRA adapters and only they train; the
    weight sync and the HF export carry the merged weights under the base model's names
    (``full_state_dict``, ``gpu_sync_send``), and the HF export also writes the adapter (peft's
    ``save_pretrained``) beside it."""

    sender: Optional[CudaIPCSender | NcclSender] = None
    objective: Optional[Objective] = None  # RL runs: made at setup

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
        if algo.kind == "rl":  # the RL objective, its registered parts looked up once (rlhf.algos.objective)
            from rlhf.algos.objective import Objective

            self.objective = Objective(algo)

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
        self.engine.train()
        module = self.engine.module
        n_opt = len(denominators)
        per_step = size(batch) // n_opt
        R = response_width(batch)
        on_policy = "old_logp" not in batch
        stats = StatSums()
        pg_total, flops = 0.0, 0.0
        steps: list = []  # (mark before, mark after) each optimizer step
        longest = 0  # the largest packed micro-batch, in tokens (what the plan sizes activations for)
        dev = self.torch_device()
        graphs = graphs_compiled()

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
                mb = to_device({key: block[key][rows] for key in TOKEN_KEYS if key in block}, dev)
                longest = max(longest, int(p["input_ids"].numel()))
                lp, ent = self._token_logprobs(module, p, with_entropy=True)
                logp = unpack(lp, p, len(rows), R)
                ent = unpack(ent, p, len(rows), R)
                terms = self.objective.policy_loss_terms(logp, ent, mb, denominators[k], self.world_size)
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
        # graphs dynamo compiled during this update (compiled layers, the compiled head): 0 once warm;
        # an update slower than its neighbours with some here paid for a recompile
        out["perf/compiled_graphs"] = (float(graphs_compiled() - graphs), 1.0)
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
        stats = StatSums()  # the objectives' tensors summed on the device, read once after the loop
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

    # -- GPU weight sync (the driver's side: rlhf.workers.schedule.CudaTransport); every rank calls both
    def gpu_sync_setup(self, engines: Sequence[Any]) -> float:
        """This rank's sender for the run's placement, given the rollout engines; seconds to set up."""
        self.sender = sender_for(self.spec, engines, self.rank)
        return self.sender.setup()

    def gpu_sync_send(self, bucket_mb: int = 512) -> dict[str, float]:
        """The current weights to the rollout engines, in buckets of ``bucket_mb``; the sender's figures."""
        from rlhf.models.load import torch_dtype

        return self.sender.send(WeightSource(self.engine.module, bucket_bytes=int(bucket_mb) << 20,
                                             dtype=torch_dtype(self.spec.model.dtype)))


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


class StatSums:
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
