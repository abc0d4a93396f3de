"""Regional compilation of a Hugging Face decoder (``model.compile_layers``).

Each decoder layer is ``torch.compile``d on its own (``nn.Module.compile``, shapes dynamic): the
layers share one class and one code object, and with their parameters as graph inputs one traced
graph serves all of them (a few more for the no-grad passes and new shape ranges), so compiling
costs about one layer's trace, not the model's. Inductor then fuses what runs between the matmuls
and the attention kernel: the RMSNorms, SwiGLU, RoPE and the residual adds (measured at Qwen2.5-0.5B
on an H200, 32k-token micro-batches: 1.12× the update with Liger's kernels, GPU idle 17.7 % → 5.6 %,
BENCHMARKS §12). Liger's kernels must be off: dynamo cannot trace them inside a compiled layer.

Applied after ``rlhf.models.varlen.use_varlen`` (the packed attention is part of the traced layer)
and before DeepSpeed wraps the model; parameters and their names are unchanged, so DeepSpeed, the
weight sync and checkpoints see the same model. A compilation that fails (dynamo, inductor or Triton
raising at a layer's first call) warns once and every layer runs eagerly from then on; an error
raised by the compiled backward cannot be caught so and ends the pass.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

log = logging.getLogger(__name__)

# dynamo keeps a compiled entry per guard set: forward with and without grad, train and eval, a few
# dynamic-shape ranges. The default limit (8) is low enough that recompiles of the shared code would
# leave layers eager; the probe's values (bench/mfu_probe.py).
CACHE_SIZE_LIMIT = 64
ACCUMULATED_CACHE_SIZE_LIMIT = 512


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model (``base_model.layers``: Llama, Qwen2, Mistral and
    their sequence-classification and token-classification variants), through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "base_model", base)
    layers = getattr(body, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def compile_layers(model, backend: Optional[str] = None) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (dynamic shapes; ``backend`` None =
    inductor; "aot_eager" traces the same graphs without generating code, as CPU runs do). Returns
    how many layers were compiled (0 for a model whose layers are not found, with a warning)."""
    layers = decoder_layers(model)
    if not layers:
        warnings.warn(f"model.compile_layers: no decoder layers found in {type(model).__name__}; running it eagerly")
        return 0
    from torch._dynamo import config

    config.cache_size_limit = max(config.cache_size_limit, CACHE_SIZE_LIMIT)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, ACCUMULATED_CACHE_SIZE_LIMIT)
    kw = {"dynamic": True} | ({"backend": backend} if backend else {})
    for layer in layers:
        layer.compile(**kw)
        layer._compiled_call_impl = _guarded(layer, layer._compiled_call_impl, layers)
    log.info("model.compile_layers: %d decoder layers compiled (%s)", len(layers), backend or "inductor")
    return len(layers)


def compiled(model) -> bool:
    """Whether ``model``'s decoder layers run compiled (none has fallen back to eager)."""
    layers = decoder_layers(model)
    return bool(layers) and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)


def _guarded(layer: torch.nn.Module, fn, layers: list[torch.nn.Module]):
    """``fn`` (the layer's compiled call); on a compilation failure every layer goes back to its eager
    call (``nn.Module`` calls ``_call_impl`` when no compiled one is set), with one warning."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise  # not a compilation problem: the eager layer would need the memory too
        except Exception as e:  # noqa: BLE001 - a dynamo/inductor/Triton failure must not stop training
            warnings.warn(f"model.compile_layers: torch.compile of the decoder layers failed ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); running them eagerly")
            for each in layers:
                each._compiled_call_impl = None
            return layer._call_impl(*args, **kwargs)

    return call
