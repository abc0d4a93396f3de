"""The HF export of a trained role (the actor's causal LM, the critic's token-value model):
``from_pretrained``-ready weights and tokenizer, and a LoRA policy's adapter beside them."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch


class Exported(Protocol):
    """What the export reads of a trained worker (``rlhf.workers.trained.TrainedWorker``)."""

    rank: int
    lora: bool
    engine: Any  # the DeepSpeed engine; ``engine.module`` is the model

    def on_rank0(self, fn: Callable[[torch.nn.Module], Any]) -> Any: ...

    def model_path(self) -> str: ...


def save_hf(worker: Exported, path: str) -> Optional[str]:
    """Write ``worker``'s model (full weights, gathered under ZeRO-3) and its tokenizer in HF format to
    ``path`` on rank 0, ``from_pretrained``-ready. Returns the path on rank 0, else None.

    LoRA: ``path`` holds the merged model (base architecture, ``W + (alpha/r)·B A``), and
    ``adapter_dir(path)`` the adapter alone (``PeftModel.from_pretrained(base, adapter)``)."""
    from pathlib import Path

    from rlhf.models.lora import merged_state_dict

    # one gather under ZeRO-3 for both: the merged weights and (LoRA) the adapter's own tensors
    states = worker.on_rank0(lambda m: (merged_state_dict(m), own_state_dict(m) if worker.lora else None))
    if worker.rank != 0:
        return None
    state, raw = states
    from rlhf.models import load_tokenizer

    from rlhf.storage import publish

    out = Path(path)
    module = worker.engine.module
    if worker.lora:
        from rlhf.models.lora import adapter_dir

        with publish(adapter_dir(out)) as tmp:
            module.save_pretrained(str(tmp), state_dict=raw)
        module = module.get_base_model()  # the HF model; ``state`` has its parameter names
    # written beside and renamed: a run killed mid-export leaves no ``hf`` dir that looks whole
    with publish(out) as tmp:
        module.save_pretrained(str(tmp), state_dict=state)
        load_tokenizer(worker.model_path()).save_pretrained(str(tmp))
    return str(out)


def own_state_dict(module) -> dict[str, torch.Tensor]:
    """The module's own state dict on the CPU (for a LoRA model: peft names, adapters included)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}
