"""Model and tokenizer loading: local Hugging Face checkpoints, Hub ids and the built-in tiny model.

    path = resolve_model_path(spec.model.path)   # builtin:tiny -> a generated checkpoint dir;
                                                 # org/name -> its snapshot in the HF cache
    path = model_dir(spec)                       # in workers: the dir the driver's preflight resolved
    tok = load_tokenizer(path)
    model = load_model(path, "causal_lm" | "token_value" | "sequence_score", dtype)
"""

from rlhf.models.load import load_model, load_tokenizer, model_dir, resolve_model_path, torch_dtype

__all__ = ["load_model", "load_tokenizer", "model_dir", "resolve_model_path", "torch_dtype"]
