"""What the plan, the launcher and the schedule know of the vLLM engine (``rlhf.rollout.vllm``)
before starting it; no torch, no vLLM. The formulas are in docs/memory.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rlhf.rollout.registry import DTYPE_BYTES, GB, EngineKind, register_engine

if TYPE_CHECKING:
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.spec.runspec import RunSpec

# A sleeping vLLM engine keeps its CUDA context and CUDA-graph pool.
VLLM_ASLEEP_GB = 1.0
# A further engine on a GPU (placement.rollout.engines_per_device): its process's CUDA context and
# runtime, which vLLM's gpu_memory_utilization share does not include (the first engine's is in the
# plan's runtime of every GPU).
VLLM_ENGINE_CONTEXT_GB = 1.0
# Host memory of an engine: its engine-core process and one GPU worker (model code, CUDA graphs'
# host side, the tokenizer); a further TP worker is a plain GPU process.
HOST_VLLM_ENGINE_GB = 8.0
PARTS = ("vLLM asleep", "vLLM (awake)", "vLLM weights", "vLLM KV cache + activations", "vLLM more engines' runtime")


@register_engine
class VLLMKind(EngineKind):
    """vLLM (``rlhf.rollout.vllm.VLLMEngine``): GPU only, sleeps between phases, takes weights
    over CUDA IPC (sharing the trainer's GPUs) or NCCL; a TP > 1 engine runs vLLM's Ray executor
    on the bundles of its GPUs."""

    name = "vllm"
    accelerators = ("cuda",)
    auto_on = ("cuda",)
    seeded = False  # vLLM's batch shapes change its kernels' sums: samples depend on their batch
    sleeps = True
    device_weights = True
    dead_errors = ("EngineDeadError", "AsyncEngineDeadError")  # the engine core process is gone
    # vLLM measures the device's free memory while it profiles (its KV cache is its share less what
    # the profile saw taken): a neighbour starting at the same time would be counted as its own
    starts_alone_on_device = True
    # at 0.5B on an H200 one engine keeps the GPU busy 20 % of its kernel span (the Python scheduler
    # and output handling between steps); two engines generated 1.48x the tokens/s of one, four no
    # more than two (BENCHMARKS §10). In the RL loop (sleep, wake and the weight sync of both engines
    # beside the trainer, same trainer-vLLM mismatch): generation 1.41x and the step 1.24x at 0.5B,
    # 1.21x and 1.10x at 1.5B; at 512 response tokens (0.5B) generation only 1.04x, the step 0.99x (not
    # explained yet, BENCHMARKS §10). rlhf.plan.auto takes two only where the memory fits
    auto_engines_per_device = 2

    def death(self, error: str) -> str:
        return f"vLLM's engine core stopped ({error}; the engine's log has the cause)"

    def prepare(self) -> bool:
        from rlhf.rollout.vllm import import_vllm

        import_vllm()
        return True

    def create(self, spec: RunSpec, tokenizer: Any, device: str, settings: dict[str, Any]) -> RolloutEngine:
        from rlhf.rollout.vllm import VLLMEngine

        return VLLMEngine(spec, tokenizer, **settings)

    def gpu_memory(self, spec: RunSpec, params: int) -> dict[str, float]:
        """Per GPU, for its n engines (``Layout.engines_per_device``): n × weights / TP, the KV cache
        + activations filling the rest of the share (rollout.gpu_memory_utilization, split between
        the n), and (n − 1) × VLLM_ENGINE_CONTEXT_GB for the further engines' processes."""
        n = spec.layout.engines_per_device
        weights = n * DTYPE_BYTES[spec.model.dtype] * params / spec.layout.rollout_tp / GB
        share = spec.rollout.gpu_memory_utilization * spec.hardware.device_memory_gb
        out = {"vLLM weights": weights, "vLLM KV cache + activations": max(share - weights, 0.0)}
        if n > 1:
            out["vLLM more engines' runtime"] = (n - 1) * VLLM_ENGINE_CONTEXT_GB
        return out

    def resident_while_training(self, spec: RunSpec, params: int) -> dict[str, float]:
        n = spec.layout.engines_per_device
        if spec.placement.sleep_rollout:
            return {"vLLM asleep": n * VLLM_ASLEEP_GB}
        out = {"vLLM (awake)": spec.rollout.gpu_memory_utilization * spec.hardware.device_memory_gb}
        if n > 1:
            out["vLLM more engines' runtime"] = (n - 1) * VLLM_ENGINE_CONTEXT_GB
        return out

    def host_gb(self, spec: RunSpec, gpus_on_node: int, process_gb: float) -> float:
        return HOST_VLLM_ENGINE_GB + process_gb * (gpus_on_node - 1)

    def memory_parts(self) -> tuple[str, ...]:
        return PARTS

    def min_tensor_parallel(self, spec: RunSpec) -> int:
        """The smallest TP (dividing a node and the heads) at which vLLM's weights leave half its
        share for the KV cache; 0 if none does."""
        from rlhf.plan.memory import param_count
        from rlhf.placement.layout import tp_splits_heads

        m, hw = spec.model, spec.hardware
        share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
        weights = DTYPE_BYTES[m.dtype] * param_count(m) / GB
        for tp in range(1, hw.devices_per_node + 1):
            if hw.devices_per_node % tp == 0 and tp_splits_heads(m, tp) and weights / tp <= share / 2:
                return tp
        return 0

    def launch_settings(self, spec: RunSpec, bundles: tuple[int, ...], share: float) -> Optional[dict[str, Any]]:
        """TP > 1: vLLM's Ray executor starts one worker per TP rank on ``bundles``
        (``VLLM_RAY_BUNDLE_INDICES``) of the worker's placement group, each taking ``share`` of its
        GPU; the worker process holds no GPU. TP 1 runs in the worker process."""
        if spec.layout.rollout_tp <= 1:
            return None
        return {"bundle_indices": bundles, "gpu_share": share}
