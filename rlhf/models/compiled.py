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
raising at a layer's first call) warns once and every layer runs eagerly from then on. The compiled
backward is built at the first backward, inside autograd, where no layer call can catch its failure:
so the trained roles compile it before training (``warm_up``), on a copy of one layer, and a failure
there turns the layers eager the same way.

A call that fails every compiled entry's guards is traced again, which costs a GPU step seconds:
``graphs_compiled`` counts the graphs (the actor reports each update's as ``perf/compiled_graphs``)
and torch's ``recompiles`` log, turned on here unless ``TORCH_LOGS`` is set, names the failed guard
in the worker's log.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
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
    if "TORCH_LOGS" not in os.environ:  # a recompile costs seconds of a step: its failed guard goes to the worker's log
        torch._logging.set_logs(recompiles=True)
    kw = {"dynamic": True} | ({"backend": backend} if backend else {})
    for layer in layers:
        layer.compile(**kw)
        layer._compiled_call_impl = _guarded(layer, layer._compiled_call_impl, layers)
    log.info("model.compile_layers: %d decoder layers compiled (%s)", len(layers), backend or "inductor")
    return len(layers)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far: each layer graph's first trace, and
    one more each time a call fails every compiled entry's guards (a shape class not seen yet, another
    grad mode) and is traced again, which costs its step seconds of compilation."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled, and importing dynamo costs a CPU run seconds
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def backend_for(device: str) -> Optional[str]:
    """inductor on CUDA; on CPU dynamo's and AOTAutograd's tracing only (``aot_eager``: inductor's C++
    build would take minutes and gain nothing there)."""
    return None if device == "cuda" else "aot_eager"


def warm_up(model, device, dtype: torch.dtype, backend: Optional[str] = None, tokens: int = 24) -> bool:
    """Compile the layers' training graphs, forward and backward, before training: one packed forward
    and backward of ``tokens`` random hidden states (two sequences) through a copy of ``model``'s base
    model holding a copy of its first layer, on ``device`` in ``dtype``, compiled like the layers. The
    layers share their code and take their parameters as graph inputs, so the graphs built here are
    the ones the first real pass finds; the copy shares no parameter with ``model`` (no gradient, no
    DeepSpeed hook of the real model runs). If the copy's compiled pass fails where its eager pass
    runs, every layer of ``model`` goes back to eager with one warning (what ``_guarded`` does for a
    forward; a failing backward would otherwise end the first update). Returns whether the layers
    still run compiled; a model whose base model this cannot copy is left as it is."""
    from rlhf.models.varlen import no_mask

    layers = decoder_layers(model)
    if not layers or not compiled(model):
        return compiled(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "base_model", base)
    lens = (tokens // 3, tokens - tokens // 3)
    cu = torch.tensor([0, lens[0], tokens], dtype=torch.int32, device=device)
    kw = dict(position_ids=torch.cat([torch.arange(n) for n in lens])[None].to(device), attention_mask=no_mask(device),
              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens), use_cache=False)

    def fwd_bwd(shell, hidden) -> None:
        x = hidden.clone().requires_grad_(True)
        shell(inputs_embeds=x, **kw).last_hidden_state.float().square().mean().backward()

    try:
        shell = _copy_without_layers(body, layers[0], device, dtype)
        # a generator of its own: the warm-up leaves the process's random state as it was
        hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        hidden = hidden.to(device, dtype)
        fwd_bwd(shell, hidden)  # eager: if this fails, the warm-up does not fit the model (not the compiler's fault)
    except Exception as e:  # noqa: BLE001 - an unusual model: its first real pass compiles, as without a warm-up
        log.info("model.compile_layers: no warm-up for %s (%s: %s)", type(body).__name__, type(e).__name__, e)
        return True
    first = shell.layers[0]
    first.compile(dynamic=True, **({"backend": backend} if backend else {}))
    try:
        fwd_bwd(shell, hidden)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a dynamo/AOTAutograd/inductor failure, forward or backward
        _run_eagerly(layers, e, " before training")
        return False
    return True


def _copy_without_layers(body: torch.nn.Module, layer: torch.nn.Module, device, dtype: torch.dtype) -> torch.nn.Module:
    """``body`` (a transformers base model) as a new module with one copy of ``layer`` as its layers,
    copies of its other parts except the token embedding (the warm-up passes ``inputs_embeds``), on
    ``device``, floating parameters in ``dtype``."""
    shell = copy.copy(body)
    shell._modules = {}
    shell._parameters = {}
    shell._buffers = dict(body._buffers)
    for name, child in body._modules.items():
        if child is None or isinstance(child, torch.nn.Embedding):
            shell._modules[name] = None
            continue
        if isinstance(child, torch.nn.ModuleList) and any(m is layer for m in child):
            one = copy.deepcopy(layer)
            one._compiled_call_impl = None  # the copy's own compile follows (the original's is bound to it)
            shell._modules[name] = torch.nn.ModuleList([one])
        else:
            shell._modules[name] = copy.deepcopy(child)
    if body._parameters:
        raise ValueError("parameters outside its sub-modules")
    shell.to(device)
    for p in shell.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return shell


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
            _run_eagerly(layers, e)
            return layer._call_impl(*args, **kwargs)

    return call


def _run_eagerly(layers: list[torch.nn.Module], e: BaseException, when: str = "") -> None:
    """Every layer back to its eager call (``nn.Module`` calls ``_call_impl`` when no compiled one is
    set), with one warning naming the failure."""
    text = str(e).strip()
    warnings.warn(f"model.compile_layers: torch.compile of the decoder layers failed{when} ({type(e).__name__}: "
                  f"{text.splitlines()[0][:200] if text else ''}); running them eagerly")
    for layer in layers:
        layer._compiled_call_impl = None
