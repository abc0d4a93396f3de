"""Model FLOPs of a pass, for the ``perf/mfu`` metric.

Counted as the model's own arithmetic (no recomputation), for a decoder of ``N_body`` matmul
weights (every 2-D weight of the backbone but the embedding), an LM head of ``V·h`` weights
applied to the ``M`` predicted tokens only, and causal attention over packed samples of
lengths ``s_i`` (Narayanan et al. 2021, with the causal half):

    forward = 2·N_body·L + 2·V·h·M + 2·n_layers·d_attn·Σ s_i²        (L = Σ s_i tokens)
    training pass (forward + backward) = 3 × forward

MFU = counted FLOPs / (seconds × peak FLOP/s of the devices used).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopShape:
    body_params: int  # matmul weights of the backbone
    head_params: int  # V·h (0 for a model with a small head, e.g. a critic)
    attn_width: int  # n_layers · n_heads · head_dim

    def forward(self, tokens: float, predicted: float, sq_lengths: float) -> float:
        return 2.0 * self.body_params * tokens + 2.0 * self.head_params * predicted + 2.0 * self.attn_width * sq_lengths


def flop_shape(model) -> FlopShape:
    """The counts of an HF model (plain, peft-wrapped or DeepSpeed-partitioned: ``ds_numel``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    embed = base.get_input_embeddings()
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    body = 0
    for p in base.parameters():
        if p.dim() == 2 and id(p) not in embed_ids and id(p) not in head_ids:
            body += int(getattr(p, "ds_numel", p.numel()))
    n_heads = getattr(cfg, "num_attention_heads", 0) or 0
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // max(n_heads, 1))
    vocab_h = cfg.vocab_size * cfg.hidden_size if head is not None else 0
    return FlopShape(body, vocab_h, cfg.num_hidden_layers * n_heads * head_dim)
