"""The two collectives of the parameters kept outside FSDP2 by rows (embedding.py, router_gate.py), on
torch's functional collectives by their ops: funcol's Python wrappers were renamed between torch 2.11 and 2.13."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


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
