"""bench.vllm_nested: the product's vLLM kind under another name, with only the logprob layout changed."""

from __future__ import annotations

import sys

import pytest

import rlhf.rollout.vllm as rv
from rlhf.rollout import registry
from rlhf.rollout.vllm_kind import VLLMKind


@pytest.fixture
def own_registry(monkeypatch):
    """The plugin registers into a copy of the registry, and its module is imported afresh: other
    tests in this process see the engine names they expect (no vllm_nested)."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    monkeypatch.delitem(sys.modules, "bench.vllm_nested", raising=False)
    yield
    sys.modules.pop("bench.vllm_nested", None)


def test_nested_kind_is_vllm_with_nested_logprobs(monkeypatch, own_registry):
    kind = registry.get("vllm_nested", ["bench.vllm_nested"])
    base = registry.get("vllm")
    assert isinstance(kind, VLLMKind) and kind.name == "vllm_nested" and base.name == "vllm"
    # what the plan and the launcher ask of it is vLLM's
    for attr in ("accelerators", "sleeps", "device_weights", "auto_engines_per_device", "starts_alone_on_device"):
        assert getattr(kind, attr) == getattr(base, attr)

    made = []
    monkeypatch.setattr(rv, "VLLMEngine", lambda spec, tok, **kw: made.append(kw) or "engine")
    assert kind.create(None, None, "cuda", {"gpu_share": 0.5}) == "engine"
    assert made == [{"gpu_share": 0.5, "flat_logprobs": False}]
    base.create(None, None, "cuda", {})
    assert made[-1] == {}  # the product's kind leaves the default (flat) alone
    assert rv.EngineConfig(model_path="/m").flat_logprobs is True


def test_the_registration_stays_in_its_test():
    assert "vllm_nested" not in registry.names()
