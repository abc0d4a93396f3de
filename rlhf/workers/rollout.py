"""The rollout worker: a Ray actor holding one rollout engine, made by the run's engine kind
(``rlhf.rollout.registry``: HF, vLLM or a plugin's), called by ``rlhf.rollout.generate``, by a
caller sampling one request at a time (``sample``), by the weight sync and by the schedule."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Sequence

from rlhf.rollout import registry
from rlhf.rollout.engine import Sample, Sampling
from rlhf.workers.base import Worker

if TYPE_CHECKING:
    from rlhf.spec.runspec import RunSpec


class RolloutWorker(Worker):
    """One rollout engine (on GPU a vLLM engine, whose TP ranks are vLLM's own Ray workers when
    TP > 1; one process on CPU), held as ``engine``;
    every method the driver, the weight senders and the hybrid schedule call forwards to it.
    ``engine_settings``: what the launcher decides for this engine
    (``rlhf.rollout.registry.EngineKind.launch_settings``: a TP > 1 vLLM engine's placement-group
    bundles and GPU share)."""

    def __init__(self, spec: RunSpec, role: str, rank: int, world_size: int,
                 engine_settings: Optional[dict] = None):
        super().__init__(spec, role, rank, world_size)
        self.engine_settings = dict(engine_settings or {})

    def prepare(self) -> None:
        """The engine kind's work before its start (``EngineKind.prepare``: vLLM's imports), called by
        the launcher as soon as the worker exists; its seconds go to the worker's log, and from there
        to the console's set-up line."""
        from rlhf.track.worker_logs import ENGINE_IMPORTS

        t0 = time.perf_counter()
        if registry.kind(self.spec).prepare():
            print(f"{ENGINE_IMPORTS} {time.perf_counter() - t0:.1f} s", flush=True)

    def setup(self) -> None:
        from rlhf.models import load_tokenizer, model_dir

        self.tokenizer = load_tokenizer(model_dir(self.spec))
        self.engine = registry.kind(self.spec).create(self.spec, self.tokenizer, self.device, self.engine_settings)

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        # an engine needs no process group of the trainers'; vLLM sets up its own TP group
        self.setup()

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        return self.engine.generate(prompt_token_ids, sampling)

    def sample(self, prompt_ids: list[int], sampling: Sampling) -> Sample:
        """One continuation (``RolloutEngine.sample``); ``await worker.sample.remote(...)`` from an
        asyncio loop keeps several trajectories' requests in flight."""
        return self.engine.sample(prompt_ids, sampling)

    def load_weights(self, named_tensors: dict) -> None:
        self.engine.load_weights(named_tensors)

    def engine_sleep(self, level: int = 1) -> dict:
        return self.engine.sleep(level)

    def engine_wake(self, tags: Optional[Sequence[str]] = None) -> float:
        return self.engine.wake_up(tags)

    def close(self) -> None:
        self.engine.close()

    # -- an engine that takes weights on the device (EngineKind.device_weights: vLLM), from the
    # trainer's senders (rlhf.workers.sync_cuda)
    def load_ipc(self, handles: dict, metas: list) -> float:
        return self.engine.load_ipc(handles, metas)

    def load_nccl(self, metas: list, nbytes: int) -> float:
        return self.engine.load_nccl(metas, nbytes)

    def sync_done(self, release: bool = True) -> None:
        return self.engine.sync_done(release)

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int):
        return self.engine.init_weight_group(master_address, master_port, rank_offset, world_size)

    def weight_digest(self) -> dict:
        return self.engine.weight_digest()
