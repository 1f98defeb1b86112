"""The embedding sharded by rows (parallel/embedding.py) on 2 gloo ranks: each rank's lookup equals a plain
embedding of the full weight, in the compute dtype, and the gradient each rank keeps for its rows is the sum
over both ranks' tokens, exactly (integer-valued gradients: any summation order gives the same fp32), for a
vocabulary split evenly, unevenly, and over fewer rows than ranks (one rank holds none); and where
[parallelism] embedding's `auto` shards by rows and `rows` refuses. The trained model's sharded init and first
gradients against one process: tests/test_sharded_init.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.parallel.embedding import embed_sharded_rows, shard_embedding_rows

D = 6


def rows_worker(rank: int, world: int, port: int, vocab: int, dtype: torch.dtype, failures) -> None:
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        full = torch.randn(vocab, D)
        tokens = torch.randint(0, vocab, (world, 3, 5))  # every rank draws all ranks' tokens alike
        grads = torch.randint(-4, 5, (world, 3, 5, D)).to(dtype)
        embedding = nn.Embedding(vocab, D)
        with torch.no_grad():
            embedding.weight.copy_(full)
        shard_embedding_rows(embedding, mesh, dtype)
        weight = embedding.weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        assert torch.equal(weight.full_tensor(), full)

        out = embed_sharded_rows(tokens[rank], weight, dtype)
        assert out.dtype == dtype and out.shape == (3, 5, D)
        assert torch.equal(out, F.embedding(tokens[rank], full.to(dtype)))
        out.backward(grads[rank])
        expected = torch.zeros(vocab, D, dtype=torch.float64)
        expected.index_add_(0, tokens.flatten(), grads.flatten(0, -2).double())
        assert isinstance(weight.grad, DTensor) and weight.grad.placements == (Shard(0),)
        assert weight.grad.dtype == torch.float32
        assert torch.equal(weight.grad.full_tensor().double(), expected)


@pytest.mark.parametrize("vocab", [8, 7, 1], ids=["even", "uneven", "fewer_rows_than_ranks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_rank_looks_up_its_tokens_and_keeps_its_rows_gradient_summed_over_ranks(vocab, dtype):
    run_ranks(rows_worker, 2, vocab, dtype)


def precision_worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(1)
        tokens = torch.zeros(world, 64, dtype=torch.long)  # every token of both ranks on row 0
        grads = torch.randn(world, 64, D).to(torch.bfloat16)
        embedding = nn.Embedding(4, D)
        shard_embedding_rows(embedding, mesh, torch.bfloat16)
        embed_sharded_rows(tokens[rank], embedding.weight, torch.bfloat16).backward(grads[rank])
        expected = grads.double().sum(dim=(0, 1))
        row0 = embedding.weight.grad.full_tensor()[0].double()
        # Summed in fp32: a few fp32 roundings off the float64 sum; one bf16 rounding would be ~1e-3 relative.
        assert torch.allclose(row0, expected, rtol=1e-5, atol=1e-5), (row0 - expected).abs().max()


def test_the_gradient_of_a_row_is_summed_in_fp32_over_every_ranks_tokens():
    run_ranks(precision_worker, 2)


def test_shard_embedding_rows_refuses_a_two_dimensional_mesh():
    class Mesh:
        ndim, mesh_dim_names = 2, ("dp_replicate", "fsdp")

    with pytest.raises(ValueError, match="a 1-D mesh, got 2-D"):
        shard_embedding_rows(nn.Embedding(4, D), Mesh(), torch.bfloat16)


class FakeMesh:
    def __init__(self, *shape: int):
        self.ndim, self._size = len(shape), int(torch.tensor(shape).prod())

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("setting, mesh, tied, expected", [
    ("auto", FakeMesh(2), False, True),
    ("auto", FakeMesh(2, 2), False, False),  # HSDP
    ("auto", FakeMesh(1), False, False),
    ("auto", FakeMesh(2), True, False),
    ("fsdp", FakeMesh(2), False, False),
    ("rows", FakeMesh(4), False, True),
    ("rows", FakeMesh(2, 2), False, "HSDP replicates it"),
    ("rows", FakeMesh(1), False, "its FSDP group has one rank"),
    ("rows", FakeMesh(2), True, "the output layer shares its weight"),
])
def test_auto_shards_the_embedding_by_rows_where_it_can_and_rows_refuses_elsewhere(setting, mesh, tied, expected):
    from torchtitan_moe.config.sections import ConfigError
    from torchtitan_moe.models.qwen3_moe.parallelize import embedding_by_rows

    model = nn.Module()
    model.tok_embeddings, model.output = nn.Embedding(8, D), nn.Linear(D, 8, bias=False)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=rf"\[parallelism\] embedding = 'rows'.*{expected}.*: use 'fsdp' or 'auto'"):
            embedding_by_rows(setting, model, mesh)
    else:
        assert embedding_by_rows(setting, model, mesh) is expected
