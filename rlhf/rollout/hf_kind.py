"""What the plan, the launcher and the schedule know of the HF engine (``rlhf.rollout.hf``) before
starting it; no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.rollout.registry import DTYPE_BYTES, GB, EngineKind, register_engine

if TYPE_CHECKING:
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.spec.runspec import RunSpec


@register_engine
class HFKind(EngineKind):
    """Hugging Face sampling with the model's KV cache (``rlhf.rollout.hf.HFEngine``): CPU runs
    and GPU runs without vLLM. It keeps its weights (in the model's dtype) on its GPU; the KV
    cache of a batch comes and goes with each call and is not planned."""

    name = "hf"
    auto_on = ("cpu",)
    needs_seeds = True  # every sample draws from its own generator, seeded from the prompt's seed

    def create(self, spec: RunSpec, tokenizer: Any, device: str, settings: dict[str, Any]) -> RolloutEngine:
        from rlhf.models import load_model, model_dir
        from rlhf.rollout.hf import HFEngine

        model = load_model(model_dir(spec), "causal_lm", "float32" if device == "cpu" else spec.model.dtype,
                           pad_token_id=tokenizer.pad_token_id)
        if device == "cuda":
            model = model.cuda()
        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device=device)

    def gpu_memory(self, spec: RunSpec, params: int) -> dict[str, float]:
        """Each engine on a GPU (``Layout.engines_per_device``) holds its own weights."""
        return {"HF engine weights": spec.layout.engines_per_device * DTYPE_BYTES[spec.model.dtype] * params / GB}

    def memory_parts(self) -> tuple[str, ...]:
        return ("HF engine weights",)
