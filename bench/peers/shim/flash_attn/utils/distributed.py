"""``flash_attn.utils.distributed.all_gather`` (concatenate along dim 0 over a process group)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    world = dist.get_world_size(process_group)
    out = input_.new_empty(world * input_.shape[0], *input_.shape[1:])
    dist.all_gather_into_tensor(out, input_.contiguous(), group=process_group)
    return out
