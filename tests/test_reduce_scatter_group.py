"""FSDP2's reduce-scatters on process groups of their own (parallel/reduce_scatter.py) on gloo ranks: the
gradients equal the shared group's to the bit, every FSDP2 module's reduce-scatter goes through the new group
(a group of FSDP2's shard ranks, not FSDP2's own), under FSDP (2 ranks) and HSDP (2 replicas x 2); a group of
other ranks is refused. The trained model against the shared group: tests/test_train_cpu.py."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.parallel.reduce_scatter import OwnGroupReduceScatter, reduce_scatter_on_own_groups, shard_ranks

D = 8


def model_on(mesh, separate: bool):
    """Two FSDP2 blocks and a root, the same weights on every rank; their reduce-scatters' comms if separate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Linear(D, 1))
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # gloo has no AVG
            module.set_force_sum_reduction_for_comms(True)
    comms = reduce_scatter_on_own_groups([(m, mesh) for m in (model[0], model[1], model)]) if separate else []
    return model, comms


def gradients(model, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)  # other data on every rank
    model(torch.randn(6, D)).square().sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def worker(rank: int, world: int, port: int, shape: tuple[int, ...], failures) -> None:
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        shared = gradients(model_on(mesh, separate=False)[0], rank)
        model, comms = model_on(mesh, separate=True)
        used = []  # the groups the reduce-scatters went through
        original = dist.reduce_scatter_tensor
        dist.reduce_scatter_tensor = lambda *args, group=None, **kwargs: used.append(group) or original(
            *args, group=group, **kwargs)
        try:
            got = gradients(model, rank)
        finally:
            dist.reduce_scatter_tensor = original
        assert all(torch.equal(a, b) for a, b in zip(got, shared)), f"rank {rank}: gradients differ"

        assert len(comms) == 3 and len({id(c) for c in comms}) == 1  # one group for one set of ranks
        comm = comms[0]
        fsdp_group = mesh.get_group(mesh.ndim - 1)
        assert comm.group is not fsdp_group and comm.group != dist.group.WORLD
        assert comm.ranks == shard_ranks(mesh) == dist.get_process_group_ranks(fsdp_group)
        assert used == [comm.group] * 3  # each FSDP2 module's reduce-scatter, through it

        alone = OwnGroupReduceScatter(dist.new_group([rank], use_local_synchronization=True))
        out, inp = torch.empty(1), torch.zeros(len(comm.ranks))
        with pytest.raises(RuntimeError, match=r"FSDP2 reduces over ranks \[.*\], this group holds \[.*\]"):
            alone(out, inp, fsdp_group, dist.ReduceOp.SUM)


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["fsdp-2", "hsdp-2x2"])
def test_reduce_scatters_on_their_own_group_give_the_shared_groups_gradients(shape):
    run_ranks(worker, math.prod(shape), shape)
