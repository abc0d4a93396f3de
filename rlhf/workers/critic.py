"""PPO's critic: ``AutoModelForTokenClassification`` with one label, the checkpoint's backbone and
a new linear head giving one value per position; the value of response token t is read at the
position that predicts it (the state before the action), like the policy's logits. Its HF export
is every trained role's (``TrainedWorker.save_hf``)."""

from __future__ import annotations

import torch

from rlhf.data.batch import Batch, response_width, select, size
from rlhf.data.packing import TOKEN_KEYS, unpack
from rlhf.workers.model import to_device
from rlhf.workers.trained import Stats, TrainedWorker


class CriticWorker(TrainedWorker):
    """PPO's value model, trained with the clipped value loss."""

    kind = "token_value"

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
                mb = to_device({key: block[key][rows] for key in TOKEN_KEYS if key in block}, dev)
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
