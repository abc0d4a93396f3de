"""Rollout engines by name: ``rollout.engine=<name>`` picks an ``EngineKind``, and everything
outside the rollout package asks the kind instead of comparing engine names.

An ``EngineKind`` is what the spec, the plan, the launcher and the schedule know of an engine
before (and without) starting it: where it runs, whether it sleeps between phases, how it takes
the trained weights, what it holds in device and host memory, what its launcher slot needs. Its
``create`` makes the engine itself (``rlhf.rollout.engine.RolloutEngine``) inside the rollout
worker. This module imports no torch (the spec and ``--plan`` read the kinds); a kind imports
its engine's heavy modules inside ``create``.

    @register_engine                           # in a module named in rollout.plugins
    class Echo(HFKind):                        # rlhf.rollout.hf_kind.HFKind
        name = "echo"
        def create(self, spec, tokenizer, device, settings): ...

The built-ins are declared by module (``rlhf.rollout.hf_kind``, ``rlhf.rollout.vllm_kind``) and
imported on first use; a second registration under a name is an error. ``rollout.plugins``
names the modules that register more; every process that looks an engine up imports them first
(``kind(spec)``: the driver's validation, plan and loop, the rollout workers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

from rlhf.plugins import import_problem

if TYPE_CHECKING:
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.spec.runspec import RunSpec

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class EngineKind:
    """What rlhf knows of a rollout engine without starting one. Subclass, set the class
    attributes, override what differs, register with ``@register_engine``."""

    name: str = ""
    accelerators: tuple[str, ...] = ("cpu", "cuda")  # hardware.accelerator values it runs on
    auto_on: tuple[str, ...] = ()  # rollout.engine=auto picks it on these accelerators
    # rollout.seeded's default: a seed per prompt, so that a sample depends on its seed alone
    seeded: bool = True
    # rollout.seeded=false is refused: without seeds every prompt would draw the same samples
    needs_seeds: bool = False
    # sleep() frees its device memory while the models beside it train (the schedule calls it when
    # the placement shares its devices with trained roles and placement.sleep_rollout is on)
    sleeps: bool = False
    # on GPU it takes the trained weights from the trainer's CUDA IPC / NCCL senders
    # (rlhf.workers.sync_cuda: load_ipc, load_nccl, ...); otherwise load_weights of the full
    # state dict through Ray's object store
    device_weights: bool = False
    # exception class names meaning the engine died under a live worker (rlhf.launch.failures)
    dead_errors: tuple[str, ...] = ()
    # the engine sizes its memory from what the device has free while it starts: engines that share
    # a device (placement.rollout.engines_per_device) start one after another, and engines beside
    # model workers (hybrid) once those have loaded (rlhf.launch.cluster.start_cluster)
    starts_alone_on_device: bool = False
    # placement.rollout.engines_per_device=auto for a small model (rlhf.plan.auto) at TP 1 on CUDA:
    # more than 1 where one engine leaves the GPU waiting on its host side (measured for vLLM)
    auto_engines_per_device: int = 1

    def death(self, error: str) -> str:
        """The cause in the run's error line when the engine raised ``error`` (one of ``dead_errors``)."""
        return f"the {self.name} engine stopped ({error}; the engine's log has the cause)"

    # ---- the engine itself (in the rollout worker)

    def prepare(self) -> bool:
        """The imports the rollout worker can do before its engine may start, touching no device;
        whether there were any. The launcher has every rollout worker do it as soon as it exists,
        beside the models' loading, since in hybrid placement the engines' start waits for those
        (``rlhf.launch.cluster.start_cluster``)."""
        return False

    def create(self, spec: RunSpec, tokenizer: Any, device: str, settings: dict[str, Any]) -> RolloutEngine:
        """The engine for this worker: ``device`` "cpu" or "cuda", ``settings`` what the launcher
        decided for it (``launch_settings``)."""
        raise NotImplementedError(f"rollout engine {self.name!r} has no create()")

    # ---- the plan

    def gpu_memory(self, spec: RunSpec, params: int) -> dict[str, float]:
        """GB per GPU of one engine rank while it generates, by part (``params``: the policy's
        parameter count)."""
        return {}

    def resident_while_training(self, spec: RunSpec, params: int) -> dict[str, float]:
        """GB per GPU it keeps while the roles sharing its GPUs train (asleep, or awake when it
        cannot sleep or placement.sleep_rollout is off)."""
        return self.gpu_memory(spec, params)

    def host_gb(self, spec: RunSpec, gpus_on_node: int, process_gb: float) -> float:
        """Host memory (GB) of one engine whose TP group has ``gpus_on_node`` GPUs on a node;
        ``process_gb``: what the plan counts for a GPU worker process (rlhf.plan.memory)."""
        return process_gb * gpus_on_node

    def memory_parts(self) -> tuple[str, ...]:
        """The names of its memory parts (no allocator slack is added to them: they are not the
        training processes' tensors)."""
        return ()

    def min_tensor_parallel(self, spec: RunSpec) -> int:
        """The smallest TP at which its weights leave it room to generate; 0 if none does."""
        return 1

    # ---- the launcher

    def launch_settings(self, spec: RunSpec, bundles: tuple[int, ...], share: float) -> Optional[dict[str, Any]]:
        """Settings for an engine whose own processes take its devices (the worker process then
        holds none): given the placement-group ``bundles`` of its devices and the ``share`` of
        each that the placement gives it. None: the worker process takes its devices itself."""
        return None

    # ---- validation

    def problems(self, sections: dict[str, Any]) -> list[str]:
        """What is wrong with the config for this engine (beyond where it runs), one line each."""
        return []


class RegistryError(ValueError):
    """An unknown engine name, or a name registered twice."""


_BUILTIN_HOMES = {"hf": "rlhf.rollout.hf_kind", "vllm": "rlhf.rollout.vllm_kind"}
_KINDS: dict[str, EngineKind] = {}


def register_engine(cls: type[EngineKind]) -> type[EngineKind]:
    """Class decorator: register an engine kind under ``cls.name``."""
    name = cls.name
    if not name or name == "auto":
        raise RegistryError(f"{cls.__module__}.{cls.__qualname__}: an engine kind needs a name other than 'auto'")
    if name in _KINDS:
        old = type(_KINDS[name])
        raise RegistryError(f"rollout engine {name!r} is registered twice: by {old.__module__}.{old.__qualname__} "
                            f"and by {cls.__module__}.{cls.__qualname__}. Choose another name.")
    if name in _BUILTIN_HOMES and cls.__module__ != _BUILTIN_HOMES[name]:
        raise RegistryError(f"rollout engine {name!r} is a built-in ({_BUILTIN_HOMES[name]}). Choose another name.")
    _KINDS[name] = cls()
    return cls



def load_plugins(modules: Sequence[str]) -> None:
    """Import the modules named in ``rollout.plugins`` (their decorators register engines)."""
    for name in modules:
        importlib.import_module(name)


def names(plugins: Sequence[str] = ()) -> tuple[str, ...]:
    """Every engine name: the built-ins, then what ``plugins`` (and earlier imports) registered."""
    load_plugins(plugins)
    return tuple(_BUILTIN_HOMES) + tuple(n for n in _KINDS if n not in _BUILTIN_HOMES)


def get(name: str, plugins: Sequence[str] = ()) -> EngineKind:
    """The kind registered under ``name`` (importing ``plugins``, and a built-in's module, first)."""
    if name not in _KINDS:
        load_plugins(plugins)
    if name not in _KINDS and name in _BUILTIN_HOMES:
        importlib.import_module(_BUILTIN_HOMES[name])
    if name not in _KINDS:
        raise RegistryError(f"rollout.engine={name!r} is not valid. Choose one of: auto, {', '.join(names(plugins))} "
                            "(or register another in a module named in rollout.plugins).")
    return _KINDS[name]


def kind(spec: RunSpec) -> EngineKind:
    """The run's engine kind (``spec.rollout_engine``, ``auto`` already resolved by the build)."""
    return get(spec.rollout_engine, spec.rollout.plugins)


def resolve(name: str, accelerator: str, plugins: Sequence[str] = ()) -> str:
    """``rollout.engine`` with ``auto`` replaced: the first engine whose ``auto_on`` names the
    accelerator (vllm on cuda, hf on cpu)."""
    if name != "auto":
        return name
    for n in names(plugins):
        if accelerator in get(n).auto_on:
            return n
    return "hf"


def plugin_problem(module: str) -> Optional[str]:
    """None if module ``module`` imports, else one line naming it, the error and the fix."""
    return import_problem("rollout.plugins", module)
