"""Load models and tokenizers from a local HF checkpoint dir or ``builtin:<name>``.

Model kinds:

* ``causal_lm``       AutoModelForCausalLM (policy, reference, rollout);
* ``token_value``     AutoModelForTokenClassification with 1 label: the critic, one value per
                      position (the backbone comes from the checkpoint, the head is new);
* ``sequence_score``  AutoModelForSequenceClassification with 1 label: a reward model, one score
                      per sequence (read at the last non-pad token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.spec.errors import UserError

KINDS = ("causal_lm", "token_value", "sequence_score")


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_model_path(path: str, model_spec: Any = None) -> str:
    """``builtin:<name>`` -> its generated dir; otherwise a local HF checkpoint dir (checked)."""
    if path.startswith("builtin:"):
        from rlhf.models.builtin import builtin_model_dir

        return str(builtin_model_dir(path.split(":", 1)[1], model_spec))
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"model path {path!r} does not exist. Give a local Hugging Face checkpoint dir "
            "(with config.json), or model.path=builtin:tiny."
        )
    if not (p / "config.json").exists():
        raise UserError(
            f"model path {path!r} is not a Hugging Face checkpoint: it has no config.json. "
            "Point at the dir that save_pretrained wrote."
        )
    return str(p)


def skip_sklearn() -> None:
    """transformers' auto classes import scikit-learn (~4 s) for assisted generation, which no
    process of ours uses: hidden before the first load, in the driver and in every worker."""
    try:
        import transformers.utils as tu

        tu.is_sklearn_available = lambda: False
    except ImportError:  # pragma: no cover
        pass


def load_tokenizer(path: str):
    skip_sklearn()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - reported with the path and the fix
        raise UserError(f"cannot load a tokenizer from {path!r}: {type(e).__name__}: {e}".split("\n")[0]) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, kind: str = "causal_lm", dtype: str = "float32", pad_token_id: int | None = None):
    skip_sklearn()
    import transformers

    if kind not in KINDS:
        raise ValueError(f"model kind {kind!r}: expected one of {KINDS}")
    cls = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_value": transformers.AutoModelForTokenClassification,
        "sequence_score": transformers.AutoModelForSequenceClassification,
    }[kind]
    kwargs: dict = {"dtype": torch_dtype(dtype)}
    if kind != "causal_lm":
        kwargs["num_labels"] = 1
    try:
        model = cls.from_pretrained(path, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load a {kind} model from {path!r}: {type(e).__name__}: {e}".split("\n")[0]) from None
    if pad_token_id is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_token_id
    return model


def apply_liger(model) -> None:
    """Liger's fused RMSNorm, SwiGLU and RoPE kernels in this model instance (``model.liger_kernels``).
    Its fused cross-entropy stays off: log-probs are computed by ``rlhf.algos.logprobs``."""
    import inspect

    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise UserError("model.liger_kernels=true needs the liger-kernel package (pip install liger-kernel). "
                        "Install it or use model.liger_kernels=false.") from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(base.config, "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise UserError(f"model.liger_kernels=true: Liger has no kernels for model_type={model_type!r}. "
                        "Use model.liger_kernels=false.")
    want = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
            "fused_linear_cross_entropy": False, "model": base}
    params = inspect.signature(fn).parameters
    fn(**{k: v for k, v in want.items() if k in params})
