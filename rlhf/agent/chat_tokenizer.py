"""A tiny chat tokenizer for tests and CPU agent tasks: byte-level BPE (any text round-trips
exactly), ChatML role markers, Hermes tool-call tags, and a chat template that renders system /
user / assistant / tool messages and the tools' schemas.

The built-in model's tokenizer (``rlhf.models.builtin``) knows only the keymap words, so it cannot
spell a JSON tool call; this one can. Built in about a tenth of a second, deterministically (the
BPE merges are learned from a fixed synthetic corpus).
"""

from __future__ import annotations

import json

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML turns; tools listed in the system turn by name and parameters (compact: a tiny model's
# context is short; a real model's template writes their JSON schemas); consecutive tool answers share one user turn,
# each in <tool_response> tags; an assistant's structured tool_calls rendered as Hermes JSON.
CHAT_TEMPLATE = (
    "{%- set nl = '\\n' -%}"
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if tools -%}"
    "<|im_start|>system{{ nl }}{% if sys %}{{ sys }}{{ nl }}{% endif %}Tools:"
    "{%- for t in tools %} {{ t.function.name }}({{ (t.function.parameters.properties or {}) | join(', ') }})"
    "{%- endfor %}<|im_end|>{{ nl }}"
    "{%- elif sys -%}<|im_start|>system{{ nl }}{{ sys }}<|im_end|>{{ nl }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|im_start|>user{{ nl }}{%- endif -%}"
    "<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<|im_end|>{{ nl }}{%- else -%}{{ nl }}{%- endif -%}"
    "{%- elif m.role != 'system' -%}"
    "<|im_start|>{{ m.role }}{{ nl }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}{{ nl }}<tool_call>{{ nl }}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{ nl }}</tool_call>"
    "{%- endfor -%}<|im_end|>{{ nl }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ nl }}{%- endif -%}"
)


def _corpus() -> list[str]:
    keys = [f"k{i}" for i in range(8)]
    out = []
    for i, k in enumerate(keys):
        call = json.dumps({"name": "lookup", "arguments": {"key": k}})
        out += [f"key {k}", f"<tool_call>\n{call}\n</tool_call>", f"value v{(i * 3) % 8}",
                "print(sum(range(10)))", "def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3",
                "The answer is", "Error: unknown tool", "system user assistant tool", "Tools: lookup(key)"]
    for op in ("+", "-", "*"):  # the code task (rlhf.data.agent_tasks)
        for c in range(10):
            out += [f"Write f(x) = x {op} {c} in Python.", f"```python\ndef f(x):\n    return x {op} {c}\n```"]
    return out * 4


def build_chat_tokenizer(vocab_size: int = 512):
    """The tokenizer (a ``PreTrainedTokenizerFast``) with CHAT_TEMPLATE; eos is ``<|im_end|>``,
    the token that ends an assistant turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # merges may cross spaces and punctuation (a tool call's fixed JSON becomes a few tokens), never digits
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.add_tokens(TOOL_TAGS)  # plain added tokens: kept when decoding with skip_special_tokens
    fast.chat_template = CHAT_TEMPLATE
    return fast
