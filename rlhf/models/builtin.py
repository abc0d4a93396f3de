"""The built-in tiny models: randomly initialised Llamas. ``tiny`` has the keymap task's word
tokenizer; ``tiny-chat`` the byte-level chat tokenizer of ``rlhf.agent.chat_tokenizer`` (a ChatML
template with tool calls: the agent tasks, ``rlhf.data.agent_tasks``).

Built on first use under ``cache_dir()/models/<name>-<hash of its numbers>`` and then loaded with
``from_pretrained`` like any checkpoint. Creation is atomic (write a temporary dir, rename), so
concurrent processes (Ray workers starting together, parallel tests) are safe.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from rlhf.paths import cache_dir
from rlhf.spec.schema import ModelSpec
from rlhf.storage import atomic_dir

BUILTIN_MODELS = ("tiny", "tiny-chat")
MAX_POSITIONS = {"tiny": 256, "tiny-chat": 512}
INIT_SEED = 0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
)


def build_tokenizer():
    """A word-level tokenizer over the keymap vocabulary, wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlhf.data.builtin import VOCAB

    vocab = {w: i for i, w in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenizer_for(name: str):
    """The tokenizer of built-in model ``name``."""
    if name == "tiny-chat":
        from rlhf.agent.chat_tokenizer import build_chat_tokenizer

        return build_chat_tokenizer()
    return build_tokenizer()


def vocab_size(name: str) -> int:
    if name == "tiny-chat":
        return len(tokenizer_for(name))
    from rlhf.data.builtin import VOCAB

    return len(VOCAB)


def _arch(model_spec: ModelSpec, name: str = "tiny") -> dict:
    arch = {
        "n_layers": model_spec.n_layers,
        "hidden": model_spec.hidden,
        "intermediate": model_spec.intermediate,
        "n_heads": model_spec.n_heads,
        "n_kv_heads": model_spec.n_kv_heads,
        "vocab": vocab_size(name),
        "tie_embeddings": model_spec.tie_embeddings,
        "seed": INIT_SEED,
        "task_version": __import__("rlhf.data.builtin", fromlist=["VERSION"]).VERSION,
    }
    if name != "tiny":  # tiny's folder name (a hash of these) stays what it was
        arch["name"] = name
    return arch


def builtin_model_dir(name: str, model_spec: ModelSpec) -> Path:
    """The checkpoint dir of ``builtin:<name>`` for these architecture numbers (built if missing)."""
    from rlhf.spec.errors import UserError

    if name not in BUILTIN_MODELS:
        raise UserError(f"model.path=builtin:{name} is not a built-in model. Use builtin:tiny, builtin:tiny-chat "
                        "or a local HF dir.")
    arch = _arch(model_spec, name)
    if model_spec.vocab != arch["vocab"]:
        raise UserError(
            f"model.vocab={model_spec.vocab} does not match the builtin:{name} tokenizer's {arch['vocab']} tokens. "
            f"Set model.vocab={arch['vocab']} (or model=tiny-chat for builtin:tiny-chat)."
        )
    digest = hashlib.sha1(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:10]
    final = cache_dir() / "models" / f"{name}-{digest}"
    with atomic_dir(final) as tmp:
        if tmp is not None:
            _write_tiny(tmp, arch)
    return final


def hf_shape(arch: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers config arguments of a model shape given in ``model.*`` terms (the first,
    Llama/Qwen name of each in ``rlhf.spec.shape.SHAPE_KEYS``: what the plan reads back)."""
    from rlhf.spec.shape import SHAPE_KEYS

    return {keys[0]: arch[field] for field, keys in SHAPE_KEYS.items()} | {"tie_word_embeddings": arch["tie_embeddings"]}


def _write_tiny(folder: Path, arch: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    name = arch.get("name", "tiny")
    tok = tokenizer_for(name)
    config = LlamaConfig(
        **hf_shape(arch),
        max_position_embeddings=MAX_POSITIONS[name],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(arch["seed"])
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    from transformers.utils import logging as hf_logging

    # transformers draws a "Writing model shards" bar on stderr: noise before a run's first line
    hf_logging.disable_progress_bar()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
