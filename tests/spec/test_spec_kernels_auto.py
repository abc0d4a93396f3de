"""GPU kernel settings decided by the build. train.compile_logprobs: auto is on exactly for CUDA runs.
model.liger_kernels: auto resolves to on only for CUDA runs with the package importable and, when
the driver can read the checkpoint's model_type, only for a type Liger covers; true on CPU and a
value outside auto/true/false are config errors naming the fix; an auto choice lets a model type
Liger does not cover (or a worker without the package) run without (an explicit true refuses it).
liger-kernel is not installed here: the package is a fake module with Liger's table of types."""

import importlib.util
import sys
import types

import pytest

from rlhf.spec.errors import SpecError, UserError

GPU = ["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"]


def _spec(overrides):
    from rlhf.cli import build_spec, compose

    return build_spec(compose(overrides), overrides, plan=True)


def _decision(spec):
    return next(d for d in spec.auto if d.key == "model.liger_kernels")


def test_auto_off_on_cpu():
    spec = _spec([])
    assert spec.model.liger_kernels is False and _decision(spec).why == "CPU run"


def test_auto_follows_the_package_on_gpu(monkeypatch):
    real = importlib.util.find_spec
    for present in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, p=present: (object() if p else None) if name == "liger_kernel" else real(name, *a))
        spec = _spec(GPU)
        assert spec.model.liger_kernels is present
        assert ("is installed" if present else "is not installed") in _decision(spec).why


def test_a_worker_without_the_package(monkeypatch):
    """auto falls back with a log line; an explicit true names the package."""
    from rlhf.models.load import apply_liger

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as when it is not installed
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    assert apply_liger(model, required=False) is False
    with pytest.raises(UserError, match="needs the liger-kernel package"):
        apply_liger(model)


def test_explicit_values_are_kept_and_checked():
    spec = _spec([*GPU, "model.liger_kernels=false"])
    assert spec.model.liger_kernels is False and not any(d.key == "model.liger_kernels" for d in spec.auto)
    with pytest.raises(SpecError) as info:
        _spec(["model.liger_kernels=true"])
    assert "model.liger_kernels=true needs a CUDA GPU" in str(info.value) and "model.liger_kernels=false" in str(info.value)
    with pytest.raises(SpecError) as info:
        _spec(["model.liger_kernels=fast"])
    assert "model.liger_kernels='fast' is not valid" in str(info.value)


def test_uncovered_model_type(monkeypatch):
    import sys
    import types

    from rlhf.models.load import apply_liger

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="tiny-word"))
    assert apply_liger(model, required=False) is False
    with pytest.raises(UserError, match="no kernels for model_type='tiny-word'"):
        apply_liger(model)


def test_compile_logprobs_auto_by_accelerator():
    cpu, gpu = _spec([]), _spec(GPU)
    assert cpu.train.compile_logprobs is False and gpu.train.compile_logprobs is True
    assert _spec([*GPU, "train.compile_logprobs=false"]).train.compile_logprobs is False
    with pytest.raises(SpecError) as info:
        _spec(["train.compile_logprobs=maybe"])
    assert "train.compile_logprobs='maybe' is not valid. Use auto (on for CUDA runs), true or false." in str(info.value)
