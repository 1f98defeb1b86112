"""Random init of sharded (DTensor) parameters that does not depend on the sharding.

torchtitan initializes the model after FSDP2 and expert parallelism have made its parameters
DTensors, so an init function's `normal_` / `uniform_` runs on shards. DTensor keeps sharded
random ops consistent only on CUDA-like devices (its offset-based RNG tracker), and even there
the values depend on the mesh. On the CPU (gloo) every rank fills its shard from the same
generator state: with 2 ranks, experts 0-3 came out as clones of experts 4-7, and so did gate
rows, embedding rows and attention weights. Drawing op by op is not enough either: torch's
`trunc_normal_` redraws until no value is out of bounds, a loop each rank would run on its own
shard, leaving the ranks' generators apart.

`full_tensors(module)` runs the init code on full, plain tensors instead: inside it, the
module's DTensor parameters are swapped for full tensors on the local device; on the way out
each rank keeps its own shard of them. Every rank draws what a single process draws from the
same seed (torchtitan seeds all ranks alike), so the init is that of one process for any mesh,
on CPU and GPU alike, and the generators stay in step. Memory: the module's full parameters,
for the time of its init (use it per block).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@contextmanager
def full_tensors(module: nn.Module) -> Iterator[None]:
    """Inside: `module`'s DTensor parameters are full plain tensors. After: each rank's shard."""
    swapped: list[tuple[nn.Module, str, DTensor]] = []
    full: dict[int, nn.Parameter] = {}  # by id: a tied parameter gets one full tensor
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if isinstance(param, DTensor):
                if id(param) not in full:
                    local = param.to_local()
                    full[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=local.dtype, device=local.device),
                                                   requires_grad=param.requires_grad)
                swapped.append((owner, name, param))
    for owner, name, param in swapped:
        owner._parameters[name] = full[id(param)]
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param
    with torch.no_grad():
        for param in {id(p): p for _, _, p in swapped}.values():
            # Every rank holds the same full tensor: its shard is a local slice (no scatter).
            shard = distribute_tensor(full[id(param)].detach(), param.device_mesh, param.placements,
                                      src_data_rank=None)
            param.to_local().copy_(shard.to_local())
