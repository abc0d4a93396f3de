"""Load models and tokenizers from a local HF checkpoint dir, a Hugging Face Hub id or ``builtin:<name>``.

Model kinds:

* ``causal_lm``       AutoModelForCausalLM (policy, reference, rollout);
* ``token_value``     AutoModelForTokenClassification with 1 label: the critic, one value per
                      position (the backbone comes from the checkpoint, the head is new);
* ``sequence_score``  AutoModelForSequenceClassification with 1 label: a reward model, one score
                      per sequence (read at the last non-pad token).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Optional

from rlhf.hub import is_repo_id
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import ResolvedModel, RunSpec
from rlhf.spec.schema import ModelSpec

log = logging.getLogger(__name__)

KINDS = ("causal_lm", "token_value", "sequence_score")


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_model_path(path: str, model_spec: Optional[ModelSpec] = None, *, revision: Optional[str] = None,
                       what: str = "model.path", say: Optional[Callable[[str], None]] = None) -> str:
    """``builtin:<name>`` -> its generated dir; a local HF checkpoint dir (checked); else a Hugging
    Face Hub id -> its snapshot dir in the HF cache (downloaded if missing, rlhf.hub)."""
    return resolve_model(path, model_spec, revision=revision, what=what, say=say).path


def resolve_model(path: str, model_spec: Optional[ModelSpec] = None, *, revision: Optional[str] = None,
                  what: str = "model.path", say: Optional[Callable[[str], None]] = None) -> ResolvedModel:
    """``resolve_model_path`` with where it came from: a ``ResolvedModel`` (path, hub repo, commit)."""
    if path.startswith("builtin:"):
        from rlhf.models.builtin import builtin_model_dir

        skip_sklearn_and_scipy()  # a first run's driver builds the model: 1.5-5 s less of transformers' imports
        return ResolvedModel(path=str(builtin_model_dir(path.split(":", 1)[1], model_spec)))
    p = Path(path).expanduser()
    if p.exists() or not is_repo_id(path):
        if not p.exists():
            raise UserError(
                f"model path {path!r} does not exist. Give a local Hugging Face checkpoint dir "
                "(with config.json), a Hub id (org/name), or model.path=builtin:tiny."
            )
        if revision:
            raise UserError(f"{_rev_key(what)}={revision} is for a Hub id, but {what}={path} is a local dir. "
                            f"Drop {_rev_key(what)}, or give the Hub id.")
        check_checkpoint(p, path)
        return ResolvedModel(path=str(p))
    from rlhf.hub import snapshot

    snap = snapshot(path, revision=revision, what=what, choose=model_files, say=say,
                    complete=lambda d: _has_weights(Path(d)))
    check_checkpoint(Path(snap.path), f"{path} (the cached snapshot {snap.path})")
    return ResolvedModel(path=snap.path, repo=snap.repo, commit=snap.commit)


def _rev_key(what: str) -> str:
    return {"reward.model_path": "reward.model_revision", "algo.teacher.path": "algo.teacher.revision"}.get(
        what, "model.revision")


def model_dir(spec: RunSpec, role: str = "model") -> str:
    """The local checkpoint dir of ``model.path`` (role "model"), ``reward.model_path`` ("reward") or
    ``algo.teacher.path`` ("teacher")
    in this process: the one the driver's preflight resolved (``spec.models``) when this node has
    it; a Hub snapshot this node lacks is fetched here at the driver's commit (once per node: the
    HF cache locks each file); a spec that was not preflighted resolves here."""
    if role == "teacher":  # on-policy distillation's teacher (algo.teacher.path)
        from rlhf.spec.shape import teacher_model

        t = spec.algo.teacher
        path, revision, what, shape = t.path, t.revision, "algo.teacher.path", teacher_model(spec.model, t)
    else:
        path, revision, what = ((spec.model.path, getattr(spec.model, "revision", None), "model.path")
                                if role == "model" else (spec.reward.model_path, getattr(spec.reward, "model_revision", None),
                                                         "reward.model_path"))
        shape = spec.model
    done = (getattr(spec, "models", None) or {}).get(role)
    if done is not None and Path(done.path).is_dir():
        return done.path
    if done is not None and done.repo:
        return resolve_model_path(done.repo, shape, revision=done.commit, what=what)
    return resolve_model_path(path, shape, revision=revision, what=what)


# weight files transformers loads, one file or an index of shards (safetensors first)
WEIGHTS = (("model.safetensors", "model.safetensors.index.json", r"model-\d+-of-\d+\.safetensors"),
           ("pytorch_model.bin", "pytorch_model.bin.index.json", r"pytorch_model-\d+-of-\d+\.bin"))
WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".onnx_data", ".ot", ".gguf",
               ".ckpt", ".npz", ".tflite", ".mlmodel")


def model_files(names: list[str], commit: str = "") -> list[str]:
    """The files of a Hub model repo that loading needs: the top-level config, tokenizer and other
    small files, and ONE set of weights (safetensors over .bin; no original/, ONNX, GGUF, ...)."""
    top = [n for n in names if "/" not in n]
    keep = [n for n in top if not n.endswith(WEIGHT_EXTS)]
    for single, index, shard in WEIGHTS:
        if single in top:
            return keep + [single]
        if index in top:
            shards = [n for n in top if re.fullmatch(shard, n)]
            return keep + (shards or [n for n in top if n.endswith(Path(single).suffix)])
    return keep + ([n for n in top if n.endswith(".safetensors")] or [n for n in top if n.endswith(".bin")])


def _has_weights(p: Path) -> bool:
    try:
        check_checkpoint(p, str(p))
    except UserError:
        return False
    return True


def check_checkpoint(p: Path, shown: str) -> None:
    """A checkpoint dir: config.json and weights (a file, or an index whose shards are all there)."""
    if not p.is_dir() or not (p / "config.json").exists():
        raise UserError(
            f"model path {shown!r} is not a Hugging Face checkpoint: it has no config.json. "
            "Point at the dir that save_pretrained wrote."
        )
    for single, index, _ in WEIGHTS:
        if (p / single).exists():
            return
        if (p / index).exists():
            try:
                shards = sorted(set(json.loads((p / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise UserError(f"model path {shown!r}: {index} is not a readable shard index ({type(e).__name__}). "
                                "Save the checkpoint again with save_pretrained.") from None
            missing = [s for s in shards if not (p / s).exists()]
            if missing:
                raise UserError(
                    f"model path {shown!r}: {len(missing)} of the {len(shards)} weight files named in {index} are "
                    f"missing ({missing[0]}). Copy or download the checkpoint again."
                )
            return
    adapter = " It holds a LoRA adapter: give the merged model (a run's final/hf)." if \
        (p / "adapter_config.json").exists() else ""
    raise UserError(
        f"model path {shown!r} has a config.json but no weights (model.safetensors, pytorch_model.bin or a "
        f"sharded index).{adapter} Point at the dir that save_pretrained wrote."
    )


def skip_sklearn_and_scipy() -> None:
    """transformers' auto classes import scikit-learn (~2-4 s) for assisted generation, and its
    losses ``scipy.optimize`` (~0.4 s) for object detection, neither of which any process of ours
    uses: hidden from transformers (not from user code) before the first load or build of a model,
    in the driver and in every worker."""
    try:
        import transformers.utils as tu

        tu.is_sklearn_available = lambda: False
        tu.is_scipy_available = lambda: False
    except ImportError:  # pragma: no cover
        pass


def _builtin_tokenizer(path: str) -> bool:
    """``path`` is a built-in model's dir (``rlhf.models.builtin``), whose tokenizer is the generic
    ``TokenizersBackend``: what ``AutoTokenizer`` resolves it to (a Llama config, no auto_map).
    Loading that class directly skips importing ``transformers.models.auto`` (~2.5 s of CPU: its
    modules pull in torch._dynamo and the DTensor ops), which the driver needs for nothing else."""
    from rlhf.models.builtin import BUILTIN_MODELS
    from rlhf.paths import cache_dir

    p = Path(path)
    if p.parent != cache_dir() / "models" or not re.fullmatch(rf"({'|'.join(map(re.escape, BUILTIN_MODELS))})-[0-9a-f]+",
                                                              p.name):
        return False
    try:
        conf = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return conf.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in conf


def load_tokenizer(path: str):
    skip_sklearn_and_scipy()
    if _builtin_tokenizer(path):
        from transformers import TokenizersBackend as AutoTokenizer
    else:
        from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - reported with the path and the fix
        raise UserError(f"cannot load a tokenizer from {path!r}: {type(e).__name__}: {e}".split("\n")[0]) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, kind: str = "causal_lm", dtype: str = "float32", pad_token_id: int | None = None):
    skip_sklearn_and_scipy()
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


def apply_liger(model, required: bool = True) -> bool:
    """Liger's fused RMSNorm, SwiGLU and RoPE kernels in this model instance (``model.liger_kernels``).
    Its fused cross-entropy stays off: log-probs are computed by ``rlhf.algos.logprobs``.
    ``required=False`` (the setting was auto): a model type Liger does not cover, or a process without
    the package, runs without; returns whether the kernels were applied."""
    import inspect

    from rlhf.plan.auto import LIGER_NOT_INSTALLED, liger_coverage

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(base.config, "model_type", None)
    covered, why = liger_coverage(model_type)
    if not covered:
        if not required:
            log.info("model.liger_kernels=auto: %s; running without", why)
            return False
        if why == LIGER_NOT_INSTALLED:
            raise UserError("model.liger_kernels=true needs the liger-kernel package (pip install liger-kernel). "
                            "Install it or use model.liger_kernels=false.")
        raise UserError(f"model.liger_kernels=true: {why}. Use model.liger_kernels=false.")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    want = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
            "fused_linear_cross_entropy": False, "model": base}
    params = inspect.signature(fn).parameters
    fn(**{k: v for k, v in want.items() if k in params})
    return True
