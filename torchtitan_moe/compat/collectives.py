"""The collectives of the parameters kept outside FSDP2 by rows (parallel/embedding.py, parallel/router_gate.py),
on torch's functional collectives by their ops: funcol's Python wrappers were renamed between torch 2.11 and 2.13."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def all_gather(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[n, ...] on each rank of a 1-D mesh -> [W*n, ...], ranks in mesh order."""
    group = mesh.get_group()
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(t, group.size(), group.group_name))


def reduce_scatter_sum(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[W*n, ...] on each rank of a 1-D mesh -> this rank's [n, ...] of their sum."""
    group = mesh.get_group()
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.reduce_scatter_tensor(t, "sum", group.size(), group.group_name))


def gathered_rows(weight: DTensor) -> torch.Tensor:
    """The whole weight [E, D] (a plain tensor) from one sharded by rows (Shard(0) on a 1-D mesh: the router's
    gate, parallel/router_gate.py); its gradient goes back to each rank's rows, summed over the ranks."""
    # to_local: autograd hands the local gradient back as the DTensor's, Shard(0).
    return _GatheredRows.apply(weight.to_local(), weight.device_mesh)


class _GatheredRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return all_gather(local.contiguous(), mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sum(grad.contiguous(), ctx.mesh), None
