"""The all-to-all dispatcher's own: its exchanges, host ops and host syncs, the worst-case layout, what a
recompute keeps (against the local dispatcher, with the others: tests/test_dispatchers.py)."""

import pytest
import torch
import torch.distributed as dist
from host_reads import HostReads, HostSyncs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from spawn_ranks import count_exchanges, rank_group, run_ranks
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions

DIM, EXPERTS, TOP_K, INTER = 16, 8, 3, 12


def make_layer(padding: str, zero_gate: bool, kernels: str = "torch") -> MoE:
    torch.manual_seed(0)  # the same weights on every rank
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding=padding, kernels=kernels,
                        router=RouterOptions(init_std=0.0 if zero_gate else 0.5)), DIM)
    layer.init_weights(out_std=0.1)
    return layer


def forward_backward(layer: MoE, x: torch.Tensor, grad: torch.Tensor, use_checkpoint: bool = False):
    x = x.clone().requires_grad_()
    out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad


def exchanges_worker(rank: int, world: int, port: int, failures):
    with rank_group(rank, world, port, failures):
        torch.manual_seed(100 + rank)
        x, grad = torch.randn(2, 7, DIM), torch.randn(2, 7, DIM)
        for buffers, expected in (("exact", 7), ("worst_case", 6)):
            layer = make_layer("none", False)
            mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
            for name in ("w13", "w2"):
                setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
            layer.set_dispatcher(AllToAllDispatcher(EXPERTS, dist.group.WORLD, buffers=buffers))
            calls: list = []
            original = dist.all_to_all_single
            count_exchanges(calls)
            try:
                forward_backward(layer, x, grad)
            finally:
                dist.all_to_all_single = original
            assert len(calls) == expected, f"{buffers}: {len(calls)} all-to-all calls"


def test_a_layer_makes_seven_exchanges_and_six_with_worst_case_buffers():
    # Forward: the counts (exact buffers only), the rows, their metadata, the way back; backward: the rows,
    # their metadata, the way back. (Against the local dispatcher: tests/test_dispatchers.py.)
    run_ranks(exchanges_worker, 2)


def recompute_worker(rank: int, world: int, port: int, failures):
    with rank_group(rank, world, port, failures):
        torch.manual_seed(100 + rank)
        x, grad = torch.randn(2, 7, DIM), torch.randn(2, 7, DIM)
        mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
        # (buffers, recompute) -> exchanges and host reads in forward + recompute + backward, and whether the
        # forward keeps rows: replay makes no exchange again; "exchange" makes the forward's again without
        # its counts (kept: no host read again), and keeps no tensor.
        expected = {("exact", "replay"): (7, 1, True), ("exact", "exchange"): (10, 1, False),
                    ("worst_case", "replay"): (6, 0, True), ("worst_case", "exchange"): (9, 0, False)}
        for (buffers, recompute), (exchanges, reads, keeps_rows) in expected.items():
            layer = make_layer("none", False)
            for name in ("w13", "w2"):
                setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
            layer.set_dispatcher(AllToAllDispatcher(EXPERTS, dist.group.WORLD, buffers=buffers))
            plain = forward_backward(layer, x, grad)
            layer.zero_grad(set_to_none=True)
            layer.dispatcher.keep_exchanges, layer.dispatcher.recompute = True, recompute
            calls: list = []
            original = dist.all_to_all_single
            count_exchanges(calls)
            try:
                with HostSyncs() as syncs:
                    xc = x.clone().requires_grad_()
                    out = checkpoint(layer, xc, use_reentrant=False)
                    kept = [t for item in layer.dispatcher._kept for t in (item if isinstance(item, list) else [item])]
                    out.backward(grad)
            finally:
                dist.all_to_all_single = original
            got = (out.detach(), xc.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad)
            what = f"{buffers}, recompute {recompute!r}"
            for name, a, b in zip(("out", "grad x", "grad gate", "grad w13", "grad w2"), got, plain):
                assert torch.equal(a, b), f"{what}: {name} differs from the run without checkpointing"
            assert len(calls) == exchanges, f"{what}: {len(calls)} all-to-all calls"
            assert syncs.count == reads, f"{what}: {syncs.count} host reads"
            assert any(isinstance(t, torch.Tensor) for t in kept) == keeps_rows, f"{what}: kept {kept}"
            assert not layer.dispatcher._kept, f"{what}: kept items left after the backward"


def test_a_recompute_replays_or_exchanges_again_with_the_kept_sizes():
    run_ranks(recompute_worker, 2)


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels on CPU tensors need the "
                                      "interpreter; on a GPU test_gpu_e2e.py runs the dispatcher's kernels compiled")


class HostOps(TorchDispatchMode):
    """Counts the ops the host dispatches (views left out): on a GPU each is about one launch, and
    a custom op (a Triton kernel, an exchange) counts once."""

    VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "expand", "t",
             "transpose", "as_strided", "alias", "detach", "permute", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ not in self.VIEWS
        return func(*args, **(kwargs or {}))


def host_ops_worker(rank: int, world: int, port: int, failures):
    with rank_group(0, 1, port, failures):
        layer = make_layer("always", False, kernels="triton")
        x = torch.randn(64, DIM)
        routing = layer.router(x)
        dispatcher = AllToAllDispatcher(EXPERTS, dist.group.WORLD, align=8, kernels="triton")
        with HostOps() as ops:
            batch = dispatcher.start_dispatch(x, routing).wait()
            dispatcher.start_combine(batch.x, batch).wait()
        # 21 on torch 2.13 (send_plan and send_meta); the torch ops they replaced made it 46.
        assert ops.count <= 24, f"{ops.count} host ops in dispatch + combine"


@interpreter_only
def test_dispatch_and_combine_issue_few_host_ops():
    # The forward dispatch runs on the host path between the router and the experts' GEMMs, with
    # a host sync in it: every op there is a launch the GPU may wait for.
    run_ranks(host_ops_worker, 1)


def host_syncs_worker(rank: int, world: int, port: int, failures):
    with rank_group(rank, world, port, failures):
        torch.manual_seed(100 + rank)
        for buffers, expected in (("exact", 1), ("worst_case", 0)):
            layer = make_layer("always", False)
            x = torch.randn(16, DIM)
            routing = layer.router(x)
            dispatcher = AllToAllDispatcher(EXPERTS, dist.group.WORLD, align=8, buffers=buffers)
            with HostSyncs() as syncs:
                batch = dispatcher.start_dispatch(x.requires_grad_(), routing).wait()
                out = dispatcher.start_combine(batch.x * 1.0, batch).wait()
                out.sum().backward()
            # Exact buffers: the split sizes (one read per layer); worst case: none, forward and backward.
            assert syncs.count == expected, f"{buffers}: {syncs.count} host syncs in dispatch + combine"


def test_worst_case_buffers_read_nothing_back_to_the_host():
    run_ranks(host_syncs_worker, 2)


def test_fixed_capacity_places_each_ranks_rows_at_its_block():
    # 4 ranks of 2 experts, top-2: token 0 on ranks 0 and 3, token 1 on rank 1 only, token 2 on ranks 0 and 1.
    from torchtitan_moe import ops
    from torchtitan_moe.dispatch.all_to_all import fixed_capacity

    experts = torch.tensor([[0, 7], [2, 3], [1, 2]])
    num_tokens, top_k, ep = 3, 2, 4
    rank_slots, _ = ops.send_plan(experts, 2, ep, backend="torch")
    send_index = ops.routing_index(rank_slots, ep, num_slots=num_tokens * top_k, backend="torch")
    sent = fixed_capacity(send_index, rank_slots, num_tokens, ep)
    flat = lambda t, k: t * top_k + k  # noqa: E731
    expected = [flat(0, 0), flat(2, 0), -1,  # rank 0: tokens 0, 2
                flat(1, 0), flat(2, 1), -1,  # rank 1: tokens 1, 2
                -1, -1, -1,  # rank 2: none
                flat(0, 1), -1, -1]  # rank 3: token 0
    assert sent.row_slot.tolist() == expected
    for t in range(num_tokens):
        for k in range(top_k):
            row = int(sent.inv[t, k])
            assert row == -1 or sent.row_slot[row] == flat(t, k)
    assert (sent.inv >= 0).sum() == (sent.row_slot >= 0).sum()


def leftover_worker(rank: int, world: int, port: int, failures):
    with rank_group(rank, world, port, failures):
        torch.manual_seed(100 + rank)
        x, grad = torch.randn(2, 7, DIM), torch.randn(2, 7, DIM)
        for buffers in ("exact", "worst_case"):
            layer = make_layer("none", False)
            mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
            for name in ("w13", "w2"):
                setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
            layer.set_dispatcher(AllToAllDispatcher(EXPERTS, dist.group.WORLD, buffers=buffers))
            expected = forward_backward(layer, x, grad)
            layer.zero_grad(set_to_none=True)
            layer.dispatcher.keep_exchanges = True
            layer(x.flip(1))  # a forward with gradients, no backward (a probe): its kept exchanges are left over
            got = forward_backward(layer, x, grad, use_checkpoint=True)
            for name, a, b in zip(("out", "grad x", "grad gate"), got, expected):
                assert torch.equal(a, b), f"{buffers}: {name} after a forward without backward"


def test_a_forward_without_backward_leaves_nothing_for_the_next_recompute():
    run_ranks(leftover_worker, 2)
