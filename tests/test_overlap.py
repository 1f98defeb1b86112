"""[dispatch] overlap = "chunks" (moe/chunks.py) against the one-chunk layer, on 2 gloo ranks.

The same weights, tokens and output gradient through two layers that differ only in `overlap`:
the output and every gradient (tokens, router gate, both expert weights) must agree, and so must
the statistics (tokens per expert, router-loss sums) and the exchanges made (twice as many calls,
none repeated by a checkpointed recompute, nothing left kept). Two tolerances:
  - out and the tokens' gradient: bitwise. Every token's rows, expert outputs and sums are the same
    values in the same order; only the GEMMs' row count changes, and on the CPU a row's result
    does not depend on it (checked, not assumed: this test fails if it ever does).
  - the gate's and the experts' weight gradients: sums over tokens, which the chunks split in
    two partial sums added afterwards: fp32 summation order, within 1e-5 of the largest value
    (bf16 weights under DeepEP: one bf16 rounding, 2**-7 of it).
"""

import pytest
import torch
import torch.distributed as dist
from numerics import assert_close_to_max
from torch.utils.checkpoint import checkpoint

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.moe import MoE, MoEArgs
from torchtitan_moe.moe.chunks import chunk_bounds, split_routing

DIM, EXPERTS, TOP_K, INTER = 128, 8, 3, 32
NAMES = ("out", "grad x", "grad gate", "grad w13", "grad w2")


def make_layer(rank: int, world: int, overlap: str, dtype: torch.dtype, zero_gate: bool) -> MoE:
    """The same weights on every rank (this rank's expert shard), a micro-batch balance loss and a z-loss."""
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="always", kernels="torch",
                        router_init_std=0.0 if zero_gate else 0.5, bias_update_rate=0.0,
                        balance_loss="micro_batch", balance_loss_coeff=0.1, z_loss_coeff=1e-3), DIM)
    layer.init_weights(out_std=0.1)
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].to(dtype)))
    layer.overlap = overlap
    return layer


def make_dispatcher(kind: str, buffers: str, world: int):
    group = dist.group.WORLD
    if kind == "all_to_all":
        return AllToAllDispatcher(EXPERTS, group, align=8, buffers=buffers)
    from torchtitan_moe.dispatch.deepep import DeepEPDispatcher
    from torchtitan_moe.dispatch.deepep_backend import DeepEPV1, default_settings

    return DeepEPDispatcher(EXPERTS, DeepEPV1(group, default_settings(world), DIM), align=8, buffers=buffers)


def count_exchanges(calls: list) -> None:
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counting


def run_layer(layer: MoE, x, grad, use_checkpoint: bool, compiler):
    calls: list = []
    count_exchanges(calls)
    x = x.clone().requires_grad_()
    model = torch.compile(layer, backend=compiler) if compiler else layer
    out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
    out.backward(grad)
    grads = (x.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad)
    stats = (layer.tokens_per_expert.clone(), layer.router_loss_sums.clone())
    return (out.detach(), *grads), stats, len(calls)


def worker(rank: int, world: int, port: int, kind: str, buffers: str, use_checkpoint: bool, zero_gate: bool,
           compiler, failures):
    if kind == "deepep":
        import sys

        from test_deepep import load_fake_deep_ep

        sys.modules["deep_ep"] = load_fake_deep_ep()
    with rank_group(rank, world, port, failures):
        dtype = torch.bfloat16 if kind == "deepep" else torch.float32
        torch.manual_seed(100 + rank)  # other tokens on every rank; 15 tokens: chunks of 8 and 7
        x, grad = torch.randn(3, 5, DIM, dtype=dtype), torch.randn(3, 5, DIM, dtype=dtype)
        original = dist.all_to_all_single
        results = {}
        for overlap in ("none", "chunks"):
            layer = make_layer(rank, world, overlap, dtype, zero_gate)
            dispatcher = make_dispatcher(kind, buffers, world)
            dispatcher.keep_exchanges = use_checkpoint
            layer.set_dispatcher(dispatcher)
            try:
                results[overlap] = run_layer(layer, x, grad, use_checkpoint, compiler if overlap == "chunks" else None)
            finally:
                dist.all_to_all_single = original
            assert not dispatcher._kept, f"{overlap}: kept exchanges left after the backward"
        (expected, stats, calls), (got, chunk_stats, chunk_calls) = results["none"], results["chunks"]
        for name, a, b in zip(NAMES, got, expected):
            if name in ("out", "grad x"):  # per token: the same values in the same order
                assert torch.equal(a, b), f"rank {rank}: {name} differs by {(a.float() - b.float()).abs().max()}"
            elif not b.any():  # this rank's experts got no token (the zero gate)
                assert not a.any(), f"rank {rank}: {name} is not zero"
            else:  # a sum over tokens, split in two partial sums
                assert_close_to_max(a.float(), b.float(), 2**-7 if a.dtype == torch.bfloat16 else 1e-5,
                                    f"rank {rank}: {name}")
        for name, a, b in zip(("tokens_per_expert", "router_loss_sums"), chunk_stats, stats):
            assert torch.equal(a, b), f"rank {rank}: {name} {a.tolist()} != {b.tolist()}"
        if kind == "all_to_all":  # every exchange twice (once per chunk), none again in a recompute
            assert chunk_calls == 2 * calls, f"{chunk_calls} all-to-all calls chunked, {calls} unchunked"


CASES = [
    ("all_to_all", "exact", False, False),
    ("all_to_all", "worst_case", False, False),
    ("all_to_all", "exact", True, False),  # activation checkpointing replays both chunks' exchanges
    ("all_to_all", "worst_case", True, False),
    ("all_to_all", "exact", False, True),  # every token to experts 0..2: rank 1 receives nothing
    ("deepep", "exact", False, False),  # the fake deep_ep: two dispatches outstanding on one Buffer
    ("deepep", "worst_case", True, False),
]


@pytest.mark.parametrize("kind, buffers, use_checkpoint, zero_gate", CASES)
def test_chunks_match_one_chunk(kind, buffers, use_checkpoint, zero_gate):
    run_ranks(worker, 2, kind, buffers, use_checkpoint, zero_gate, None)


@pytest.mark.slow
@pytest.mark.parametrize("buffers", ["exact", "worst_case"])
def test_chunks_compiled_by_inductor_match_one_chunk_eager(buffers):
    # The whole chunked layer under torch.compile, as test_all_to_all compiles the layer.
    run_ranks(worker, 2, "all_to_all", buffers, False, False, "inductor")


def test_split_routing_counts_each_chunk_and_keeps_the_losses_whole():
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, balance_loss="micro_batch", balance_loss_coeff=0.1), DIM)
    routing = layer.router(torch.randn(15, DIM))
    bounds = chunk_bounds(15)
    assert bounds == [(0, 8), (8, 15)]
    chunks = split_routing(routing, bounds)
    assert torch.equal(chunks[0].tokens_per_expert + chunks[1].tokens_per_expert, routing.tokens_per_expert)
    for (start, end), chunk in zip(bounds, chunks):
        assert torch.equal(chunk.experts, routing.experts[start:end])
        assert torch.equal(chunk.probs, routing.probs[start:end])
        assert torch.equal(chunk.tokens_per_expert, torch.bincount(chunk.experts.flatten(), minlength=EXPERTS))
        assert chunk.aux_loss is None and chunk.balance_loss is None and chunk.z_loss is None
    with pytest.raises(ValueError, match="overlap = 'chunks' splits a layer's tokens in 2: got 1 tokens"):
        chunk_bounds(1)
