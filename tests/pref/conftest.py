"""Fixtures of the preference/SFT tests: the session's cache for all of them, and small tokenizers."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(rlhf_cache):
    """Every test here on the session's cache (tests/conftest.py), the Hub's data sets offline."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def keymap_tok():
    from rlhf.models.builtin import build_tokenizer

    return build_tokenizer()


ROLE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


@pytest.fixture(scope="session")
def chat_tok():
    """A word-level tokenizer with a role-marking chat template (<user> ... <end> <assistant> ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>", "<end>"]
    words += [f"w{i}" for i in range(40)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ROLE_TEMPLATE
    return fast
