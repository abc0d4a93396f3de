"""See ``trl/__init__.py`` of this stand-in: a class for veRL to patch, never instantiated in GRPO."""

import torch


class AutoModelForCausalLMWithValueHead(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("bench stand-in for trl: value-head models are not part of the GRPO bench")
