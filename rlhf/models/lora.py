"""LoRA adapters on the policy, through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", arXiv:2106.09685).

A target Linear ``y = W x`` keeps ``W`` (out × in) frozen and trains ``A`` (r × in, random init)
and ``B`` (out × r, zero init):

    y = W x + (alpha / r) · B A x      ⇒      merged weight  W' = W + (alpha / r) · B A

Only the trainer knows about the adapters. Everything that leaves it — the weight sync to the
rollout engines (HF on CPU, vLLM on GPU) and the HF export — carries ``W'`` under the base model's
own parameter names, so the engines load a plain checkpoint and need no LoRA support. ``W'`` is
computed into new tensors; the trained modules are never merged in place.

    model = apply_lora(model, spec.model.lora, seed)     # a peft model: only A and B train
    merged_state_dict(model)                             # {base name: W' or the frozen tensor}
    sync_entries(model)                                  # the same, lazily, for bucketed GPU sync
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # PeftModel → LoraModel → the HF model


def apply_lora(model: torch.nn.Module, lora: Any, seed: int, gradient_checkpointing: bool = False):
    """Wrap ``model`` (an HF causal LM) with LoRA adapters on ``lora.target_modules``; the base
    weights are frozen. ``A`` is drawn from ``torch`` seeded with ``seed`` (identical on every
    data-parallel rank), ``B`` starts at zero, so the wrapped model computes what ``model`` did."""
    from peft import LoraConfig, get_peft_model

    from rlhf.spec.errors import UserError

    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    cfg = LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                     target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    try:
        wrapped = get_peft_model(model, cfg)
    except ValueError as e:  # a target name the model does not have
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UserError(f"model.lora.target_modules={list(lora.target_modules)}: {str(e).splitlines()[0]} "
                        f"The model's Linear modules are: {', '.join(names)}.") from None
    for name, module in wrapped.named_modules():
        if _is_lora_module(module) and not _is_lora_linear(module):
            raise UserError(f"model.lora.target_modules: {name} is a {type(module.base_layer).__name__}; "
                            "LoRA here adapts Linear modules only. Name only Linear projections.")
    return wrapped


def adapter_dir(hf_dir: Any) -> Path:
    """Where the HF export ``<dir>/hf`` of a LoRA run keeps its adapter: ``<dir>/adapter``
    (beside, not inside: transformers would load an ``adapter_config.json`` found in the model dir)."""
    hf_dir = Path(hf_dir)
    return hf_dir.parent / ("adapter" if hf_dir.name == "hf" else f"{hf_dir.name}_adapter")


def _is_lora_module(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _is_lora_linear(module: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    from peft.tuners.lora.layer import Linear

    return isinstance(module, Linear) and isinstance(module.base_layer, torch.nn.Linear)


def is_lora_model(module: torch.nn.Module) -> bool:
    """True for a model that ``apply_lora`` wrapped (peft imported and a LoRA layer inside)."""
    if "peft" not in sys.modules:
        return False
    return any(_is_lora_module(m) for m in module.modules())


def base_name(name: str) -> str:
    """A peft parameter name → the base model's: ``base_model.model.x.q_proj.base_layer.weight``
    → ``x.q_proj.weight``."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale · B @ A`` as a new tensor in ``W``'s dtype (computed in float32 or wider)."""
    acc = torch.promote_types(w.dtype, torch.float32)
    # on GPU the hybrid placement offloads the trained adapters to host memory between updates
    # while the frozen base weight stays on the device: compute where W is
    a, b = a.to(w.device, acc), b.to(w.device, acc)
    return (w.to(acc) + scale * (b @ a)).to(w.dtype)


@dataclass
class SyncEntry:
    """One tensor of the base model: ``name``, the trainer parameters it is computed from and, for
    a merged LoRA weight, how (``fn(*tensors)``); ``fn`` None means the one parameter as it is."""

    name: str
    params: list[torch.nn.Parameter]
    fn: Optional[Callable[..., torch.Tensor]] = None

    def tensor(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if self.fn is None else self.fn(*tensors)


def _lora_parts(module: torch.nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter, float]:
    if getattr(module, "fan_in_fan_out", False) or module.use_dora.get(ADAPTER, False):
        raise NotImplementedError("merging LoRA adapters with fan_in_fan_out or DoRA")
    return module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight, float(module.scaling[ADAPTER])


def sync_entries(module: torch.nn.Module) -> list[SyncEntry]:
    """The base model's tensors, in parameter order, as entries over ``module``'s parameters.

    For a LoRA model each adapted ``...q_proj.base_layer.weight`` becomes ``...q_proj.weight`` =
    ``W + (alpha/r)·B A`` (reading ``W``, ``A``, ``B``); the adapters themselves are not entries;
    every other parameter keeps its tensor under its base name. For a plain model: each parameter
    once (tied weights appear once, under their first name), as it is."""
    lora_of: dict[str, torch.nn.Module] = {}
    if is_lora_model(module):
        lora_of = {f"{name}.base_layer.weight": m for name, m in module.named_modules() if _is_lora_module(m)}
    out: list[SyncEntry] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".lora_A." in name or ".lora_B." in name:
            continue
        layer = lora_of.get(name)
        if layer is None:
            out.append(SyncEntry(base_name(name) if lora_of else name, [p]))
            continue
        a, b, scale = _lora_parts(layer)
        out.append(SyncEntry(base_name(name), [p, a, b], lambda w, a_, b_, s=scale: merge_weight(w, a_, b_, s)))
    return out


@torch.no_grad()
def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's full state dict (CPU tensors) with every LoRA weight merged,
    ``W' = W + (alpha/r)·B A``; a plain model's state dict is returned as it is (on the CPU).

    Parameters must be whole (under ZeRO-3 call it inside ``GatheredParameters``). Tied weights
    get every name the base model's own state dict has for them."""
    if not is_lora_model(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    merged = {id(e.params[0]): e for e in sync_entries(module)}
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        e = merged.get(id(t))
        value = e.tensor([x.detach() for x in e.params]) if e is not None else t.detach()
        out[base_name(name)] = value.cpu()
    return out
