"""GPU kernel settings decided by the build. train.compile_logprobs: auto is on exactly for CUDA runs.
model.liger_kernels: auto resolves to on only for CUDA runs with the package importable and, when
the driver can read the checkpoint's model_type, only for a type Liger covers; true on CPU and a
value outside auto/true/false are config errors naming the fix; an auto choice lets a model type
Liger does not cover (or a worker without the package) run without (an explicit true refuses it).
liger-kernel is not installed here: the package is a fake module with Liger's table of types."""

import importlib.util
import json
import sys
import types

import pytest

from rlhf.spec.errors import SpecError, UserError
from tests.helpers import planned_spec

GPU = ["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"]


def _spec(overrides):
    return planned_spec(overrides)


def _decision(spec):
    return next(d for d in spec.auto if d.key == "model.liger_kernels")


def test_auto_off_on_cpu():
    spec = _spec([])
    assert spec.model.liger_kernels is False and _decision(spec).why == ""
    from rlhf.plan.render import render_plan

    assert "Liger" not in render_plan(spec)  # nothing to say about Triton kernels on a CPU run


def test_auto_follows_the_package_on_gpu(monkeypatch):
    real = importlib.util.find_spec
    for present in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, p=present: (object() if p else None) if name == "liger_kernel" else real(name, *a))
        spec = _spec(GPU)
        assert spec.model.liger_kernels is present
        assert ("is installed" if present else "is not installed") in _decision(spec).why


def _fake_liger(monkeypatch, types_covered):
    """liger_kernel as importable, with ``MODEL_TYPE_TO_APPLY_LIGER_FN`` covering ``types_covered``."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    table = types.ModuleType("liger_kernel.transformers.monkey_patch")
    table.MODEL_TYPE_TO_APPLY_LIGER_FN = {t: lambda **kw: None for t in types_covered}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, table.__name__, table)


def _checkpoint(tmp_path, model_type):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(d)


def test_auto_follows_the_checkpoint_model_type(monkeypatch, tmp_path, capsys):
    from rlhf.cli import main

    _fake_liger(monkeypatch, ["qwen2", "llama"])
    gpu = ["model=qwen2.5-0.5b", "hardware=1xh200"]
    spec = _spec([*gpu, f"model.path={_checkpoint(tmp_path, 'qwen2')}"])
    assert spec.model.liger_kernels is True and _decision(spec).why == "Liger has kernels for model_type='qwen2'"
    uncovered = f"model.path={_checkpoint(tmp_path, 'gpt_neox')}"
    spec = _spec([*gpu, uncovered])
    assert spec.model.liger_kernels is False and _decision(spec).why == "Liger has no kernels for model_type='gpt_neox'"
    assert main([*gpu, uncovered, "--plan"]) == 0
    assert "  Liger kernels off (auto: Liger has no kernels for model_type='gpt_neox')" in capsys.readouterr().out.splitlines()
    spec = _spec(["model.path=builtin:tiny", "hardware=1xh200"])
    assert spec.model.liger_kernels is True and "model_type='llama'" in _decision(spec).why


def test_the_builtin_model_type_is_the_built_checkpoints():
    from rlhf.models.builtin import builtin_model_dir
    from rlhf.spec.shape import BUILTIN_MODEL_TYPE, model_type

    spec = _spec([])
    assert model_type(str(builtin_model_dir("tiny", spec.model))) == BUILTIN_MODEL_TYPE == "llama"


def test_auto_on_an_uncached_hub_model_follows_the_package(monkeypatch, tmp_path):
    """The driver cannot know the type before the download: on, and the worker runs without when
    Liger does not cover it."""
    _fake_liger(monkeypatch, [])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = _spec(["model=qwen2.5-0.5b", "hardware=1xh200"])
    assert spec.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and spec.model.liger_kernels is True
    assert "model_type is not known before the download" in _decision(spec).why


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
    from rlhf.models.load import apply_liger

    _fake_liger(monkeypatch, [])
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


@pytest.mark.parametrize("key,fix", [("train.compile_logprobs", "auto (on for CUDA runs) or false"),
                                     ("train.expandable_segments", "false")])
def test_cuda_only_settings_are_refused_on_cpu(key, fix):
    """Set true on a CPU run they would do nothing: one line instead of a silent no-op."""
    with pytest.raises(SpecError) as info:
        _spec([f"{key}=true"])
    assert f"{key}=true needs a CUDA GPU, but hardware=cpu has none. Use {key}={fix}." in str(info.value)
    assert getattr(_spec([*GPU, f"{key}=true"]).train, key.split(".")[1]) is True  # a GPU run takes them


def test_liger_coverage_is_one_answer_for_the_driver_and_the_workers(monkeypatch):
    """``liger_coverage``: not installed, installed but failing to import, a type covered, one not."""
    from rlhf.plan.auto import LIGER_NOT_INSTALLED, liger_coverage

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as when it is not installed
    assert liger_coverage("llama") == (False, LIGER_NOT_INSTALLED)
    assert LIGER_NOT_INSTALLED == "the liger-kernel package is not installed"

    class Broken:  # finds liger_kernel, whose import then fails as with a missing or mismatched Triton
        @staticmethod
        def find_spec(name, *a):
            if name.startswith("liger_kernel"):
                raise ImportError("cannot import name 'language' from 'triton'")

    monkeypatch.delitem(sys.modules, "liger_kernel")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    assert liger_coverage("llama") == (False, "the liger-kernel package cannot be imported (ImportError)")
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])

    _fake_liger(monkeypatch, ["qwen2"])
    assert liger_coverage("qwen2") == (True, "Liger has kernels for model_type='qwen2'")
    assert liger_coverage("gpt_neox") == (False, "Liger has no kernels for model_type='gpt_neox'")
    assert liger_coverage(None) == (False, "Liger has no kernels for model_type=None")


def _compile(spec):
    return next(d for d in spec.auto if d.key == "model.compile_layers")


def test_compile_layers_auto_is_off_beside_liger_and_true_turns_liger_auto_off(monkeypatch, tmp_path, capsys):
    """model.compile_layers: auto resolves off where Liger's kernels are on (compiled layers measured
    1.12× them, under 1.25×); true keeps Liger's auto off (dynamo cannot trace its kernels in a
    compiled layer), true beside an explicit liger_kernels=true is one line naming both fixes, and a
    value outside auto/true/false is refused."""
    from rlhf.cli import main

    _fake_liger(monkeypatch, ["qwen2"])
    gpu = ["model=qwen2.5-0.5b", "hardware=1xh200", f"model.path={_checkpoint(tmp_path, 'qwen2')}"]
    spec = _spec(gpu)
    assert spec.model.compile_layers is False and spec.model.liger_kernels is True
    assert _compile(spec).why.startswith("Liger's kernels are on: compiled layers measured 1.12×")
    spec = _spec([*gpu, "model.compile_layers=true"])
    assert spec.model.compile_layers is True and spec.model.liger_kernels is False
    assert _decision(spec).why.startswith("model.compile_layers=true: inductor fuses")
    assert main([*gpu, "model.compile_layers=true", "--plan"]) == 0
    assert "  Liger kernels off (auto: model.compile_layers=true" in capsys.readouterr().out
    assert _spec([]).model.compile_layers is False  # CPU: off, nothing printed
    assert next(d.why for d in _spec([]).auto if d.key == "model.compile_layers") == ""
    with pytest.raises(SpecError) as info:
        _spec([*gpu, "model.compile_layers=true", "model.liger_kernels=true"])
    msg = str(info.value)
    assert "model.compile_layers=true with model.liger_kernels=true" in msg
    assert "model.liger_kernels=auto" in msg and "model.compile_layers=false" in msg
    with pytest.raises(SpecError) as info:
        _spec(["model.compile_layers=always"])
    assert "model.compile_layers='always' is not valid. Use auto" in str(info.value)


@pytest.mark.parametrize("extra,on,why", [
    ([], True, "Liger's kernels are off and eager layers would run: compiled, the GRPO loop's update was 1.31×"),
    (["model.liger_kernels=false"], True, "Liger's kernels are off"),
    (["algo=dpo"], False, "algo=dpo: measured in the RL loop only; model.compile_layers=true"),
    (["model.lora.rank=8"], False, "LoRA adapters: not measured with compiled layers; model.compile_layers=true"),
    (["model.gradient_checkpointing=true"], False, "activation checkpointing: not measured"),
    (["train.zero_stage=3"], False, "ZeRO-3 gathers each layer's parameters"),
    (["placement.offload_train_state=true"], False, "the training states leave the GPU each step"),
    (["train.zero_stage=2", "train.offload_optimizer=true"], False, "the optimizer on the host"),
])
def test_compile_layers_auto_on_for_rl_on_cuda_where_layers_would_run_eagerly(monkeypatch, extra, on, why):
    """Without Liger (not installed here, or set false) an RL run on CUDA compiles its decoder layers:
    the GRPO loop's update measured 1.31× eager layers at 0.5B (BENCHMARKS §12). What was not measured
    compiled stays eager (other algorithms, LoRA, checkpointing, ZeRO-3), each saying how to opt in."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    spec = _spec(["model=qwen2.5-0.5b", "hardware=1xh200", *extra])
    assert spec.model.liger_kernels is False
    assert spec.model.compile_layers is on and why in _compile(spec).why


def test_compile_layers_auto_goes_off_when_auto_zero_picks_stage_3(monkeypatch):
    """ZeRO-3 chosen by train.zero_stage=auto (decided after compile_layers) turns compiled layers back
    off, saying so; the memory figures do not move (compiled layers are planned as eager ones)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    over = ["model=llama3-8b", "hardware=2xh200", "model.gradient_checkpointing=false"]
    spec = _spec(over)
    assert spec.train.zero_stage == 3 and spec.model.compile_layers is False
    assert _compile(spec).why == ("ZeRO-3 gathers each layer's parameters in hooks around it: not measured with "
                                  "compiled layers; model.compile_layers=true")
    from rlhf.plan.memory import estimate

    forced = _spec([*over, "model.compile_layers=true"])
    assert forced.train.zero_stage == 3 and forced.model.compile_layers is True
    assert estimate(forced).totals == estimate(spec).totals
