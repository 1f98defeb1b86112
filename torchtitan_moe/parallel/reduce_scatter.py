"""FSDP2's gradient reduce-scatters on process groups of their own ([parallelism] fsdp_reduce_scatter_group).

FSDP2 runs its all-gathers and its reduce-scatters on two CUDA streams but through one process group, and so
one NCCL communicator, which runs one collective at a time. In the backward the all-gather of the next
block's weights (FSDP2's prefetch) then waits behind the reduce-scatter of the last block's gradients, and
the compute waits for the weights. With `separate`, each FSDP2 group's reduce-scatter goes through a second
group over the same ranks (one per set of ranks, created once), so the two collectives can run at once:

    all-gather      FSDP2's shard group (unchanged), as is HSDP's all-reduce over the replicas
    reduce-scatter  a group of the same ranks, its own communicator (OwnGroupReduceScatter)

The same collective over the same ranks and the same values: the gradients are bitwise those of the shared
group (tests/test_reduce_scatter_group.py, tests/test_train_cpu.py). It uses FSDP2's public hook for a
custom reduce-scatter (`FSDPModule.set_custom_reduce_scatter`), given an object with its two calls.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


class OwnGroupReduceScatter:
    """FSDP2's reduce-scatter (its `ReduceScatter` interface: `allocate` and the call) through `group`, a
    process group over the same ranks as the shard group FSDP2 hands it, instead of that one."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.checked: set[int] = set()  # ids of the FSDP2 groups found to hold the same ranks

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        if id(group) not in self.checked:  # once per FSDP2 group: a group of other ranks would sum other shards
            fsdp_ranks = dist.get_process_group_ranks(group)
            if fsdp_ranks != self.ranks:
                raise RuntimeError(f"reduce-scatter on its own group: FSDP2 reduces over ranks {fsdp_ranks}, "
                                   f"this group holds {self.ranks}")
            self.checked.add(id(group))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=self.group, async_op=async_op)


def shard_ranks(mesh: DeviceMesh) -> list[int]:
    """This rank's FSDP2 shard group on `mesh`: its last dimension (a 1-D mesh: all of it; HSDP's
    (replicate, shard): this replica's row)."""
    return dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))


def reduce_scatter_on_own_groups(sharded: Iterable[tuple[nn.Module, DeviceMesh]]) -> list[OwnGroupReduceScatter]:
    """Give every FSDP2 module in `sharded` (each with the mesh it was sharded on) a reduce-scatter through a
    group of its own over its shard ranks; modules whose shard group has one rank reduce-scatter nothing and
    are left alone. Every rank must call this with its modules in the same order (the groups are created in
    it). Returns the comm each module was given, in order (one object per set of ranks)."""
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"[parallelism] fsdp_reduce_scatter_group = 'separate' needs FSDP2's "
                           f"set_custom_reduce_scatter, which torch {torch.__version__} lacks: use 'shared'")
    comms: dict[tuple[int, ...], OwnGroupReduceScatter] = {}
    given = []
    for module, mesh in sharded:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"{type(module).__name__} is not sharded by FSDP2")
        ranks = tuple(shard_ranks(mesh))
        if len(ranks) == 1:
            continue
        if ranks not in comms:  # only this group's ranks create it: HSDP's replicas each make their own
            comms[ranks] = OwnGroupReduceScatter(dist.new_group(list(ranks), use_local_synchronization=True))
        module.set_custom_reduce_scatter(comms[ranks])
        given.append(comms[ranks])
    return given
