"""The model and hardware sections: the dtype on this accelerator, LoRA adapters, Liger kernels, compiled layers."""

from __future__ import annotations

from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import auto_bool, choice

DTYPES = ("bfloat16", "float16", "float32")
ACCELERATORS = ("cuda", "cpu")
LORA_KINDS = ("rl", "sft", "dpo")  # algo kinds whose trained model may carry LoRA adapters


def problems(s: Sections) -> list[str]:
    """model.dtype, hardware.accelerator and what the model's settings need of it; model.lora;
    model.liger_kernels and model.compile_layers (not both)."""
    model, hw, p = s["model"], s["hardware"], []
    choice(p, "model.dtype", model.dtype, DTYPES)
    choice(p, "hardware.accelerator", hw.accelerator, ACCELERATORS)
    p.extend(lora_problems(s))
    if auto_bool(p, "model.liger_kernels", model.liger_kernels, "on when the package is installed and covers the model") \
            and model.liger_kernels is True and hw.accelerator != "cuda":
        p.append("model.liger_kernels=true needs a CUDA GPU (Liger's kernels are Triton), but "
                 f"hardware={hw.name} has none. Use model.liger_kernels=false.")
    if auto_bool(p, "model.compile_layers", model.compile_layers,
                 "on for RL on CUDA where Liger's kernels are off; true compiles each decoder layer") \
            and model.compile_layers is True and model.liger_kernels is True:
        p.append("model.compile_layers=true with model.liger_kernels=true: dynamo cannot trace Liger's kernels inside "
                 "a compiled layer (inductor fuses the norms and MLP itself). Use model.liger_kernels=auto (off with "
                 "compiled layers) or false, or model.compile_layers=false.")
    if hw.accelerator == "cpu" and model.dtype == "float16":
        p.append("model.dtype=float16 is not supported on CPU. Use model.dtype=float32 or bfloat16.")
    return p


def lora_problems(s: Sections) -> list[str]:
    """model.lora: LoRA adapters on the policy (rlhf.models.lora)."""
    lora, algo, p = s["model"].lora, s["algo"], []
    if lora.rank < 0:
        p.append(f"model.lora.rank={lora.rank} must be >= 0 (0 = off, every weight trains; 8 or 16 is usual).")
    if lora.rank <= 0:
        return p
    if lora.alpha <= 0:
        p.append(f"model.lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha / rank; "
                 f"{2 * lora.rank} is usual).")
    if not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout={lora.dropout} must be in [0, 1) (0 is usual for RL).")
    if not lora.target_modules:
        p.append("model.lora.target_modules is empty: name the Linear modules to adapt, e.g. "
                 "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj].")
    if algo.kind not in LORA_KINDS:
        p.append(f"model.lora.rank={lora.rank}: LoRA trains causal-LM policies ({', '.join(LORA_KINDS)}); "
                 f"algo={algo.name} trains a sequence classifier. Set model.lora.rank=0.")
    return p
