"""GPU tests (``pytest -m gpu tests/gpu``): run on the device through ``scripts/gpu.sh``.

Every test here is marked ``gpu``; the default ``addopts`` deselect them, and where no CUDA GPU or
no vLLM is present they are skipped with the reason below. Figures the tests measure are appended
as JSON lines to ``$RLHF_GPU_OUT/results.jsonl`` (default ``/tmp/rlhf-gpu``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the tests import bench/ helpers
    sys.path.insert(0, str(ROOT))

REASON = "needs an NVIDIA GPU and vLLM"
HERE = Path(__file__).resolve().parent


def _have_gpu_and_vllm() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001
        return False
    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if _have_gpu_and_vllm():
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_05b() -> str:
    """The Qwen2.5-0.5B-shaped random checkpoint (built once per machine)."""
    from bench.common import make_random_model

    path = os.environ.get("RLHF_GPU_MODEL_05B", "/tmp/rlhf-gpu/models/qwen2.5-0.5b-random")
    return make_random_model(path, "qwen2.5-0.5b")

