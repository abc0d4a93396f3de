"""Forward-only roles: the reference policy (log-probs for the KL term), on-policy distillation's
teacher (log-probs of the student's samples) and a reward model (one score per sample), ZeRO-3
sharded when the run is."""

from __future__ import annotations

import torch

from rlhf.data.batch import Batch, size
from rlhf.workers.model import ModelWorker, ds_config


class ReferenceWorker(ModelWorker):
    """The frozen initial policy: log-probabilities for the KL term (``ModelWorker.logprobs``; ZeRO-3
    sharded if the run is)."""

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

            cfg = ds_config(self.spec, 0, 0.0, self.world_size, optimizer=False)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            return engine
        return model.to(self.torch_device())


class TeacherWorker(ReferenceWorker):
    """On-policy distillation's teacher (``algo.teacher.path``, any causal LM with the student's
    tokenizer): the log-probs of the student's sampled tokens, at the rollout temperature as the
    student's own (``rlhf.algos.distill``). With ``algo.teacher.offload`` (hybrid placement on GPU)
    its weights wait in host memory while the engines generate (``rlhf.workers.schedule``)."""

    def model_path(self) -> str:
        from rlhf.models import model_dir

        return model_dir(self.spec, "teacher")

    def offload(self) -> dict[str, float]:
        """The weights to host memory (pinned, for a fast copy back); a no-op on CPU and under ZeRO-3,
        whose partitions are small and owned by DeepSpeed (the plan counts them resident)."""
        if self.device != "cuda" or self.spec.train.zero_stage == 3:
            return {}
        import time

        t = time.perf_counter()
        self.module.to("cpu")
        for p in self.module.parameters():
            p.data = p.data.pin_memory()
        torch.cuda.empty_cache()
        return {"time/teacher_offload": time.perf_counter() - t}

    def reload(self) -> dict[str, float]:
        """The weights back on the device for the teacher's pass."""
        if self.device != "cuda" or self.spec.train.zero_stage == 3:
            return {}
        import time

        t = time.perf_counter()
        self.module.to(self.torch_device())
        return {"time/teacher_reload": time.perf_counter() - t}


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
