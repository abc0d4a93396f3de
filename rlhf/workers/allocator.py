"""The CUDA caching allocator's ``expandable_segments`` in a training process (``train.expandable_segments``).

With it, PyTorch maps the GPU memory of a growing allocation into one virtual range instead of
caching blocks of each size it met, so freed activations of one micro-batch serve the next one's
differently sized tensors and the optimizer step's large flat buffers (the reserved peak stops
moving from step to step). Buffers that another process opens by a CUDA IPC handle (the weight-sync
buckets vLLM reads) are allocated with it switched off, as plain segments.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_expandable = False


def set_expandable_segments(on: bool) -> None:
    """This process's allocator setting for its next allocations (what ``PYTORCH_CUDA_ALLOC_CONF``
    sets at start-up)."""
    global _expandable
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-generic API
        setter = torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{'True' if on else 'False'}")
    _expandable = on


@contextmanager
def plain_segments() -> Iterator[None]:
    """Allocations inside come from ordinary segments (CUDA IPC can share them), whatever the
    process's setting; the setting is back on after."""
    was = _expandable
    if was:
        set_expandable_segments(False)
    try:
        yield
    finally:
        if was:
            set_expandable_segments(True)
