"""The router's gate sharded by rows (parallel/router_gate.py) on 2 gloo ranks: the router's forward gathers the
whole fp32 gate, the gradient each rank keeps for its rows is the sum over both ranks' gradients in fp32, and
the routing equals the unsharded router's; where [parallelism] router's `auto` shards by rows and `rows` refuses.
The trained model against FSDP2's router groups, to the bit: tests/test_train_cpu.py; its sharded init and
first gradients against one process: tests/test_sharded_init.py."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from spawn_ranks import rank_group, run_ranks
from test_embedding_rows import FakeMesh
from torchtitan_moe.moe.router import Router
from torchtitan_moe.compat.collectives import gathered_rows
from torchtitan_moe.parallel.router_gate import gate_rows_problem, shard_gate_rows

D, E, K = 16, 8, 2


def gather_worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        full = torch.randn(E, D)
        grads = torch.randint(-4, 5, (world, E, D)).float()  # integer-valued: any summation order is exact
        gate = nn.Linear(D, E, bias=False)
        with torch.no_grad():
            gate.weight.copy_(full)
        shard_gate_rows(gate, mesh)
        weight = gate.weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        assert weight.to_local().shape == (E // world, D) and torch.equal(weight.full_tensor(), full)

        gathered = gathered_rows(weight)
        assert not isinstance(gathered, DTensor) and torch.equal(gathered, full)
        gathered.backward(grads[rank])
        assert isinstance(weight.grad, DTensor) and weight.grad.placements == (Shard(0),)
        assert weight.grad.dtype == torch.float32
        assert torch.equal(weight.grad.full_tensor(), grads.sum(dim=0))


def test_the_router_gathers_its_rows_and_each_rank_keeps_its_rows_gradient_summed_over_ranks():
    run_ranks(gather_worker, 2)


def routing_worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        plain = Router(D, E, K)
        plain.gate.weight.data.normal_(std=0.5)  # decisive routing
        sharded = Router(D, E, K)
        sharded.load_state_dict(plain.state_dict())
        shard_gate_rows(sharded.gate, mesh)
        x = torch.randn(world, 12, D)[rank]
        expected, got = plain(x), sharded(x)
        assert torch.equal(got.experts, expected.experts) and torch.equal(got.probs, expected.probs)
        got.probs.sum().backward()
        expected.probs.sum().backward()
        # this rank's tokens only: the sharded gradient sums both ranks', gathered here to compare
        everyone = [torch.empty_like(plain.gate.weight.grad) for _ in range(world)]
        torch.distributed.all_gather(everyone, plain.gate.weight.grad)
        torch.testing.assert_close(sharded.gate.weight.grad.full_tensor(), sum(everyone), rtol=1e-6, atol=1e-7)


def test_the_sharded_router_routes_as_the_plain_one():
    run_ranks(routing_worker, 2)


@pytest.mark.parametrize("mesh, problem", [
    (FakeMesh(2), None),
    (FakeMesh(8), None),
    (FakeMesh(2, 2), "HSDP replicates it"),
    (FakeMesh(1), "its FSDP group has one rank"),
    (FakeMesh(3), "8 experts do not split evenly over 3 ranks"),
])
def test_gate_rows_problem(mesh, problem):
    found = gate_rows_problem(mesh, E)
    assert found == problem if problem is None else problem in found
    if problem:
        with pytest.raises(ValueError, match=f"shard_gate_rows: {problem}"):
            shard_gate_rows(nn.Linear(D, E, bias=False), mesh)


@pytest.mark.parametrize("setting, mesh, expected", [
    ("auto", FakeMesh(2), True),
    ("auto", FakeMesh(2, 2), False),
    ("auto", FakeMesh(1), False),
    ("auto", FakeMesh(3), False),
    ("fsdp", FakeMesh(2), False),
    ("rows", FakeMesh(4), True),
    ("rows", FakeMesh(2, 2), "HSDP replicates it"),
    ("rows", FakeMesh(3), "do not split evenly"),
])
def test_auto_shards_the_gates_by_rows_where_it_can_and_rows_refuses_elsewhere(setting, mesh, expected):
    from torchtitan_moe.config.sections import ConfigError
    from torchtitan_moe.models.qwen3_moe.parallelize import router_by_rows

    block = nn.Module()
    block.moe = nn.Module()
    block.moe.router = Router(D, E, K)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": block})
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=rf"\[parallelism\] router = 'rows'.*{expected}.*: use 'fsdp' or 'auto'"):
            router_by_rows(setting, model, mesh)
    else:
        assert router_by_rows(setting, model, mesh) is expected
