"""The router's gate sharded by rows over the FSDP ranks and gathered by the router itself, outside FSDP2.

Under FSDP2 each block's router is a group of its own, its gate fp32 where the block all-gathers bf16:
two groups a layer. Its forward pre-hook and post-backward hook cost the host about 1 ms each a layer
(profiled) for a 0.5 MB all-gather and reduce-scatter (rank 0's profile of 30B-A3B-8l at EP = 2, local
batch 4, 2 H200s), where local batch 2 waits for the host. Here each
rank keeps the shard FSDP2 would (a DTensor, Shard(0) on the same mesh: checkpoints, the sharded init,
the clip and the optimizer see the same parameter) and the router's forward gathers it (compat/collectives.py's gathered_rows):

    forward   all-gather this rank's fp32 rows [E/W, D] -> the gate [E, D]: exact, as FSDP2's fp32 policy
    backward  reduce-scatter the gate's fp32 gradient [E, D] -> this rank's rows [E/W, D], summed over
              the ranks (FSDP2's reduction of the router: fp32, a sum, see use_sum_reductions)

Each gate row's gradient is the same fp32 reduce-scatter of the same terms as FSDP2's (its router group
holds the gate alone): the two ways train to the bit (tests/test_train_cpu.py). A 1-D mesh whose size
divides the experts (every rank the same number of rows: one collective of equal parts, no padding).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard



def gate_rows_problem(mesh: DeviceMesh, num_experts: int) -> str | None:
    """Why the gate cannot be sharded by rows over `mesh`, or None."""
    if mesh.ndim != 1:
        return f"HSDP replicates it (a {mesh.ndim}-D mesh)"
    if mesh.size() == 1:
        return "its FSDP group has one rank"
    if num_experts % mesh.size():
        return f"{num_experts} experts do not split evenly over {mesh.size()} ranks"
    return None


def shard_gate_rows(gate: nn.Linear, mesh: DeviceMesh) -> None:
    """Make `gate.weight` [E, D] this rank's rows (FSDP2's Shard(0) on `mesh`), a DTensor the router gathers."""
    weight = gate.weight
    if isinstance(weight, DTensor):
        raise ValueError("shard_gate_rows: the gate's weight is already a DTensor (sharded twice?)")
    if problem := gate_rows_problem(mesh, weight.shape[0]):
        raise ValueError(f"shard_gate_rows: {problem}")
    local = weight.detach().chunk(mesh.size(), dim=0)[mesh.get_local_rank()].clone()
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride())
    gate.weight = nn.Parameter(sharded, requires_grad=weight.requires_grad)
