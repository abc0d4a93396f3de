"""The model's architecture numbers from its own ``config.json``, when the driver can read it
before anything starts: a local checkpoint dir, or a Hub id whose snapshot is already in the HF
cache (``rlhf.hub``; nothing is downloaded here). ``model_type`` reads its transformers model type
the same way (``model.liger_kernels=auto``, rlhf.plan.auto).

The plan sizes memory and counts parameters from ``model.n_layers`` ... ``model.vocab``. A model
group (``conf/model/*.yaml``) gives them for its own checkpoint; pointing ``model.path`` at another
checkpoint must not leave the plan describing the group's model, so the checkpoint's numbers
replace the group's and the plan says so (``RunSpec.auto``, a decision per number). A Hub id that is
not cached yet is checked again after the driver fetched it (``rlhf.preflight.resolve_models``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rlhf.spec.runspec import Decision, RunSpec
from rlhf.spec.schema import ModelSpec, TeacherSpec

# model.* field -> the config.json keys that hold it, in the order tried (Llama/Qwen/Mistral
# names first, then GPT-2 / OPT style ones)
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "n_heads": ("num_attention_heads", "n_head"),
    "n_kv_heads": ("num_key_value_heads",),
    "vocab": ("vocab_size",),
}
FIELDS = (*SHAPE_KEYS, "tie_embeddings")


def config_file(path: str, revision: Optional[str] = None) -> Optional[Path]:
    """The ``config.json`` of ``model.path`` that this process can read now, else None
    (``builtin:`` models are built from the spec's numbers; an uncached Hub id has none yet)."""
    if path.startswith("builtin:"):
        return None
    p = Path(path).expanduser()
    if p.exists():
        f = p / "config.json"
        return f if f.is_file() else None
    from rlhf.hub import cached_snapshot, is_repo_id

    snap = cached_snapshot(path, revision) if is_repo_id(path) else None
    return snap / "config.json" if snap is not None and (snap / "config.json").is_file() else None


def read_shape(config: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``{model.* field: value}`` of a transformers ``config.json`` (a multimodal one's
    ``text_config``), or None when a number the plan needs is missing."""
    cfg = config
    if not any(k in cfg for k in SHAPE_KEYS["n_layers"]) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                     cfg["text_config"].get("tie_word_embeddings"))}
    shape: dict[str, Any] = {}
    for field, keys in SHAPE_KEYS.items():
        value = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        if value is None and field == "n_kv_heads":
            value = shape.get("n_heads")  # no grouped-query attention
        if value is None and field == "intermediate" and "hidden" in shape:
            value = 4 * shape["hidden"]  # GPT-2's n_inner: null means 4 × hidden
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return None
        shape[field] = value
    tie = cfg.get("tie_word_embeddings")
    # transformers' PretrainedConfig ties by default, and save_pretrained may leave a default out
    shape["tie_embeddings"] = True if tie is None else bool(tie)
    return shape


def read_config(config_json: Path) -> Optional[dict[str, Any]]:
    """A config.json's object; None when it cannot be read or is not a JSON object."""
    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def checkpoint_shape(config_json: Path) -> Optional[dict[str, Any]]:
    """``read_shape`` of a config.json file; None when it cannot be read or lacks a number."""
    config = read_config(config_json)
    return read_shape(config) if config is not None else None


# rlhf.models.builtin builds a LlamaForCausalLM
BUILTIN_MODEL_TYPE = "llama"


def model_type(path: str, revision: Optional[str] = None) -> Optional[str]:
    """The transformers ``model_type`` of ``model.path`` as far as this process can tell now:
    ``BUILTIN_MODEL_TYPE`` for ``builtin:`` models, a readable config.json's ``model_type``, else None
    (an uncached Hub id, a config.json without one)."""
    if path.startswith("builtin:"):
        return BUILTIN_MODEL_TYPE
    f = config_file(path, revision)
    config = read_config(f) if f is not None else None
    value = config.get("model_type") if config is not None else None
    return value if isinstance(value, str) else None


def apply_checkpoint_shape(model: ModelSpec) -> tuple[Decision, ...]:
    """Set the (not yet frozen) ``model``'s numbers to its checkpoint's; a decision per number
    that changed (key ``model.<field>``, given: the group's value, so a saved config reads the
    checkpoint again). A config.json that cannot be read leaves the numbers as given (loading the
    model reports the checkpoint later, with its own message)."""
    f = config_file(model.path, model.revision)
    shape = checkpoint_shape(f) if f is not None else None
    if shape is None:
        return ()
    out = []
    for k, v in shape.items():
        if getattr(model, k) != v:
            out.append(Decision(f"model.{k}", getattr(model, k), v, f"from {f}"))
            setattr(model, k, v)
    return tuple(out)


def shape_source(model: ModelSpec, decisions: tuple[Decision, ...]) -> Optional[str]:
    """``<config.json> (model.path=...)`` when ``apply_checkpoint_shape`` changed the model's
    numbers (a message about them names the file they came from), else None (the model group's)."""
    read = [d for d in decisions if d.key.startswith("model.") and d.key[6:] in FIELDS]
    return f"{read[0].why.removeprefix('from ')} (model.path={model.path})" if read else None


def shape_line(spec: RunSpec) -> Optional[str]:
    """The plan's line for the numbers read from the checkpoint, or None."""
    read = [d for d in getattr(spec, "auto", ()) if d.key.startswith("model.") and d.key[6:] in FIELDS]
    if not read:
        return None
    new = ", ".join(f"{d.key[6:]} {d.value}" for d in read)
    old = ", ".join(str(d.given) for d in read)
    return f"  shape {read[0].why}: {new} (the model group {spec.model.name} says {old})"


def shape_of(model: ModelSpec) -> dict[str, Any]:
    """The spec's architecture numbers, to compare with a checkpoint's ``read_shape``."""
    return {k: getattr(model, k) for k in FIELDS}


def teacher_model(model: ModelSpec, teacher: TeacherSpec) -> ModelSpec:
    """On-policy distillation's teacher as a ``ModelSpec`` (the plan's memory, ``builtin:`` teachers):
    the student's section with ``teacher.path`` and the teacher's numbers, each ``teacher.<field>``
    when set, else its checkpoint's config.json's when the driver can read it, else the student's.
    No LoRA: the teacher is frozen whole."""
    import dataclasses

    from rlhf.spec.schema import LoraSpec

    f = config_file(teacher.path, teacher.revision) if teacher.path else None
    read = (checkpoint_shape(f) if f is not None else None) or {}
    numbers = {k: getattr(teacher, k) if getattr(teacher, k) is not None else read.get(k, getattr(model, k))
               for k in FIELDS}
    fields = {fl.name: getattr(model, fl.name) for fl in dataclasses.fields(model)}
    fields.update(numbers, name="teacher", path=teacher.path or model.path, revision=teacher.revision,
                  lora=LoraSpec(), gradient_checkpointing=False)
    return ModelSpec(**fields)
