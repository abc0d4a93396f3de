"""Why the bf16 log-prob error of the random-weight presets grows with their size (docs/gpu.md, "The
log-prob mismatch"), on CPU: each preset's width (hidden, MLP, heads) at a few layers, the bf16
trainer head (``rlhf.algos.logprobs_from_hidden`` on the backbone's bf16 hidden states) against a
float64 forward of the same (bf16-rounded) weights, under two initialisations:

* ``hf``: what ``bench.make_model`` writes, transformers' normal(0, 0.02) for every weight at every
  width: each projection multiplies its input's scale by about 0.02·sqrt(fan_in) (0.6 at 896 wide,
  1.2 at 3584, 2.8 for a 7B MLP's 18944-wide down projection), so the residual stream and the
  logits grow with the width;
* ``fan_in``: normal(0, 1/sqrt(fan_in)) for every projection, the embeddings and the LM head
  (normal(0, 1/sqrt(hidden))): each projection keeps its input's scale at every width, and the
  logits' std is about 1 at every width.

If the growth is the random init's scale, the ``fan_in`` rows stay level across widths while the
``hf`` rows grow; if it were the trainer's numerics (ours), both would grow.

Both forwards share the weights exactly (the bf16 model cast in place to float64 after its own
forward; bf16 → float64 → bf16 is exact), including RoPE's bf16-rounded frequencies; transformers
keeps RMSNorm and RoPE in float32 even in the float64 model, about 1e-7 of error, nothing next to
bf16's.

    python -m bench.mismatch_init                      # 0.5B, 1.5B, 7B widths, 4 layers (CPU, minutes)
    python -m bench.mismatch_init --layers 2 --seqs 2 --seq-len 64 --presets qwen2.5-0.5b   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

VOCAB = 32768  # the presets' 152k vocabulary only makes the head larger: the error is the hidden state's


def build(preset_name: str, layers: int, init: str, seed: int):
    """A bf16 Qwen2 model of the preset's width with ``layers`` layers, initialised by ``init``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.common import preset
    from rlhf.models.builtin import hf_shape

    shape = {**hf_shape(preset(preset_name)), "num_hidden_layers": layers, "vocab_size": VOCAB}
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    if init == "fan_in":
        with torch.no_grad():
            for name, p in model.named_parameters():
                # the embeddings too: at 0.5B and 1.5B they are the LM head (tied)
                if name.endswith(("embed_tokens.weight", "lm_head.weight")) or (p.ndim == 2 and "proj" in name):
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    elif init != "hf":
        raise ValueError(f"init {init!r}: hf or fan_in")
    return model.to(torch.bfloat16).eval()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over tokens of |x - ref| / |ref| (L2 over the hidden dimension)."""
    return float(((x.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).mean())


@torch.no_grad()
def measure(preset_name: str, layers: int, init: str, seqs: int, seq_len: int, seed: int) -> dict:
    from rlhf.algos import logprobs_from_hidden

    t0 = time.perf_counter()
    model = build(preset_name, layers, init, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, VOCAB, (seqs, seq_len), generator=g)
    out16 = model.model(input_ids=ids, output_hidden_states=True)
    wide = model.double()  # the same (bf16-rounded) weights in float64
    out64 = wide.model(input_ids=ids, output_hidden_states=True)
    logits = wide.lm_head(out64.last_hidden_state)  # [B, T, V] float64
    # the scored tokens are samples of the float64 model, as an RL batch's are of its policy
    y = torch.multinomial(torch.softmax(logits.reshape(-1, VOCAB), -1), 1, generator=g).squeeze(-1)
    ref = torch.log_softmax(logits.reshape(-1, VOCAB), -1).gather(-1, y[:, None]).squeeze(-1)
    model = wide.to(torch.bfloat16)  # back to bf16 for the head, as the trainer holds it
    h = out16.last_hidden_state.reshape(-1, out16.last_hidden_state.shape[-1])
    lp, _ = logprobs_from_hidden(h, model.lm_head, y, vocab=VOCAB)
    d = (lp.double() - ref).abs()
    rms = [float(x.double().pow(2).mean().sqrt()) for x in out64.hidden_states]
    return {
        "preset": preset_name, "init": init, "layers": layers, "hidden": model.config.hidden_size,
        "tokens": int(y.numel()),
        "logp_abs_mean": float(d.mean()), "logp_abs_p99": float(d.quantile(0.99)),
        "logit_std": float(logits.std(dim=-1).mean()),
        "sampled_logp": float(ref.mean()),
        # the residual stream's RMS after the embeddings and after the last layer (before the final norm)
        "residual_rms_first": rms[0], "residual_rms_last": float(out64.hidden_states[-2].double().pow(2).mean().sqrt()),
        "hidden_rel_err": _rel(out16.last_hidden_state, out64.last_hidden_state),
        "layer_rel_err": [_rel(a, b) for a, b in zip(out16.hidden_states[1:-1], out64.hidden_states[1:-1])],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--inits", default="hf,fan_in")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the rows here (JSON lines)")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    print(f"{'preset':<14}{'init':<8}{'hidden':>7}{'|Δlogp| mean':>14}{'p99':>8}{'logit std':>11}"
          f"{'resid rms last':>16}{'hidden rel err':>16}{'s':>6}")
    for p in a.presets.split(","):
        for init in a.inits.split(","):
            r = measure(p, a.layers, init, a.seqs, a.seq_len, a.seed)
            rows.append(r)
            print(f"{p:<14}{init:<8}{r['hidden']:>7}{r['logp_abs_mean']:>14.5f}{r['logp_abs_p99']:>8.4f}"
                  f"{r['logit_std']:>11.3f}{r['residual_rms_last']:>16.3f}{r['hidden_rel_err']:>16.5f}{r['seconds']:>6.0f}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
