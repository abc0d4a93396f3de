"""The rollout worker: a Ray actor holding one rollout engine (``rlhf.rollout``: the HF engine on
CPU, vLLM on GPU), called by ``rlhf.rollout.generate`` and by the weight sync."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from rlhf.rollout.engine import RolloutEngine, Sample, Sampling
from rlhf.workers.base import Worker

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec


def make_engine(spec: RunSpec, model, tokenizer, device: str = "cpu", **settings) -> RolloutEngine:
    """The rollout engine for ``spec.rollout_engine``: hf (``model`` loaded by the caller) or vllm,
    with ``settings`` (``rlhf.rollout.vllm.EngineConfig`` fields) over the spec's."""
    if spec.rollout_engine == "hf":
        from rlhf.rollout.hf import HFEngine

        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device=device)
    if spec.rollout_engine == "vllm":
        from rlhf.rollout.vllm import VLLMEngine

        return VLLMEngine(spec, tokenizer, **settings)
    raise ValueError(f"unknown rollout engine {spec.rollout_engine!r}")


class RolloutWorker(Worker):
    """One rollout engine (on GPU a vLLM engine, whose TP ranks are vLLM's own Ray workers when
    TP > 1; one process on CPU), held as ``engine``;
    every method the driver, the weight senders and the hybrid schedule call forwards to it.
    ``engine_settings``: what the launcher decides for this engine (``rlhf.launch.cluster.placement``:
    a TP > 1 vLLM engine's placement-group bundles and GPU share)."""

    def __init__(self, spec: RunSpec, role: str, rank: int, world_size: int,
                 engine_settings: Optional[dict] = None):
        super().__init__(spec, role, rank, world_size)
        self.engine_settings = dict(engine_settings or {})

    def setup(self) -> None:
        from rlhf.models import load_model, load_tokenizer, model_dir

        path = model_dir(self.spec)
        self.tokenizer = load_tokenizer(path)
        model = None
        if self.spec.rollout_engine == "hf":
            model = load_model(path, "causal_lm", "float32" if self.device == "cpu" else self.spec.model.dtype,
                               pad_token_id=self.tokenizer.pad_token_id)
            if self.device == "cuda":
                model = model.cuda()
        self.engine = make_engine(self.spec, model, self.tokenizer, device="cpu" if self.device == "cpu" else "cuda",
                                  **self.engine_settings)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        # HF engines need no process group; a vLLM engine sets up its own TP group.
        self.setup()

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        return self.engine.generate(prompt_token_ids, sampling)

    def load_weights(self, named_tensors: dict) -> None:
        self.engine.load_weights(named_tensors)

    # -- a vLLM engine's: GPU weight sync (rlhf.workers.sync_cuda) and sleep mode (rlhf.workers.schedule)
    def load_ipc(self, handles: dict, metas: list) -> float:
        return self.engine.load_ipc(handles, metas)

    def load_nccl(self, metas: list, nbytes: int) -> float:
        return self.engine.load_nccl(metas, nbytes)

    def sync_done(self, release: bool = True) -> None:
        return self.engine.sync_done(release)

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int):
        return self.engine.init_weight_group(master_address, master_port, rank_offset, world_size)

    def engine_sleep(self, level: int = 1) -> dict:
        return self.engine.sleep(level)

    def engine_wake(self, tags: Optional[Sequence[str]] = None) -> float:
        return self.engine.wake_up(tags)

    def weight_digest(self) -> dict:
        return self.engine.weight_digest()
