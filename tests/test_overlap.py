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
    (bf16 weights under DeepEP: one bf16 rounding, 2**-7 of it). Measured: the gate's bitwise,
    w13's 2.4e-7 apart (fp32).
  - compiled by inductor against eager: everything within 1e-5 (its fusions round otherwise),
    as test_all_to_all compares a compiled layer.
"""

import sys
from pathlib import Path

import pytest

import torch
import torch.distributed as dist
from numerics import assert_close_to_max
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from spawn_ranks import count_exchanges, rank_group, run_ranks
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions
from torchtitan_moe.moe.chunks import chunk_bounds, split_routing

ROOT = Path(__file__).resolve().parents[1]
DIM, EXPERTS, TOP_K, INTER = 128, 8, 3, 32
NAMES = ("out", "grad x", "grad gate", "grad w13", "grad w2")


def make_layer(rank: int, world: int, overlap: str, dtype: torch.dtype, zero_gate: bool) -> MoE:
    """The same weights on every rank (this rank's expert shard), a micro-batch balance loss and a z-loss."""
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="always", kernels="torch",
                        router=RouterOptions(init_std=0.0 if zero_gate else 0.5, bias_update_rate=0.0,
                                             balance_loss="micro_batch", balance_loss_coeff=0.1, z_loss_coeff=1e-3)),
                DIM)
    layer.init_weights(out_std=0.1)
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].to(dtype)))
    layer.overlap = overlap
    return layer


def make_dispatcher(kind: str, buffers: str, world: int, kernels: str):
    group = dist.group.WORLD
    if kind == "all_to_all":
        return AllToAllDispatcher(EXPERTS, group, align=8, kernels=kernels, buffers=buffers)
    from torchtitan_moe.dispatch.deepep import DeepEPDispatcher
    from torchtitan_moe.dispatch.deepep_backend import DeepEPV1, default_settings

    return DeepEPDispatcher(EXPERTS, DeepEPV1(group, default_settings(world), DIM), align=8, kernels=kernels,
                            buffers=buffers)


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


def worker(rank: int, world: int, port: int, kind: str, buffers: str, use_checkpoint: bool | str, zero_gate: bool,
           compiler, gpus: bool, failures):
    """use_checkpoint: False, True (the recompute replays) or "exchange" (it exchanges again)."""
    device, kernels, init = torch.device("cpu"), "torch", {}
    if gpus:  # NCCL, Triton kernels, the real deep_ep
        if "fakes" in str(getattr(sys.modules.get("deep_ep"), "__file__", "")):
            del sys.modules["deep_ep"]  # left by a CPU body before this one in the same rank pool
        torch.cuda.set_device(rank)
        device, kernels, init = torch.device("cuda", rank), "triton", {"device_id": torch.device("cuda", rank)}
    elif kind == "deepep":
        from test_deepep import load_fake_deep_ep

        sys.modules["deep_ep"] = load_fake_deep_ep()
    with rank_group(rank, world, port, failures, "nccl" if gpus else "gloo", **init):
        dtype = torch.bfloat16 if kind == "deepep" else torch.float32
        torch.manual_seed(100 + rank)  # other tokens on every rank; 15 tokens: chunks of 8 and 7
        x = torch.randn(3, 5, DIM, dtype=dtype, device=device)
        grad = torch.randn(3, 5, DIM, dtype=dtype, device=device)
        original = dist.all_to_all_single
        results = {}
        for overlap in ("none", "chunks"):
            layer = make_layer(rank, world, overlap, dtype, zero_gate).to(device)
            dispatcher = make_dispatcher(kind, buffers, world, kernels)
            dispatcher.keep_exchanges = bool(use_checkpoint)
            dispatcher.recompute = "exchange" if use_checkpoint == "exchange" else "replay"
            layer.set_dispatcher(dispatcher)
            try:
                results[overlap] = run_layer(layer, x, grad, bool(use_checkpoint),
                                             compiler if overlap == "chunks" else None)
            finally:
                dist.all_to_all_single = original
            assert not dispatcher._kept, f"{overlap}: kept exchanges left after the backward"
        (expected, stats, calls), (got, chunk_stats, chunk_calls) = results["none"], results["chunks"]
        for name, a, b in zip(NAMES, got, expected):
            if name in ("out", "grad x") and not compiler and not gpus:  # per token: same values, same order
                assert torch.equal(a, b), f"rank {rank}: {name} differs by {(a.float() - b.float()).abs().max()}"
            elif not b.any():  # this rank's experts got no token (the zero gate)
                assert not a.any(), f"rank {rank}: {name} is not zero"
            else:  # sums over tokens split in two; inductor's fusions; a GPU GEMM's tiles by row count
                assert_close_to_max(a.float(), b.float(), 2**-7 if a.dtype == torch.bfloat16 else 1e-5,
                                    f"rank {rank}: {name}")
        for name, a, b in zip(("tokens_per_expert", "router_loss_sums"), chunk_stats, stats):
            if compiler and name == "router_loss_sums":  # the compiled router's z-loss rounds otherwise
                assert_close_to_max(a, b, 1e-6, f"rank {rank}: {name}")
            else:
                assert torch.equal(a, b), f"rank {rank}: {name} {a.tolist()} != {b.tolist()}"
        if kind == "deepep" and gpus:
            from torchtitan_moe.dispatch.deepep_backend import release_buffers

            release_buffers()
        if kind == "all_to_all":  # every exchange twice (once per chunk), a recompute's too
            assert chunk_calls == 2 * calls, f"{chunk_calls} all-to-all calls chunked, {calls} unchunked"


CASES = [
    ("all_to_all", "exact", False, False),
    ("all_to_all", "worst_case", False, False),
    ("all_to_all", "exact", True, False),  # activation checkpointing replays both chunks' exchanges
    ("all_to_all", "worst_case", True, False),
    ("all_to_all", "exact", "exchange", False),  # the recompute exchanges both chunks again, by their kept sizes
    ("all_to_all", "exact", False, True),  # every token to experts 0..2: rank 1 receives nothing
    ("deepep", "exact", False, False),  # the fake deep_ep: two dispatches outstanding on one Buffer
    ("deepep", "worst_case", True, False),
    ("deepep", "exact", "exchange", False),  # both chunks dispatched again by their kept handles
]


@pytest.mark.parametrize("kind, buffers, use_checkpoint, zero_gate", CASES)
def test_chunks_match_one_chunk(kind, buffers, use_checkpoint, zero_gate):
    run_ranks(worker, 2, kind, buffers, use_checkpoint, zero_gate, None, False)


@pytest.mark.slow
def test_chunks_compiled_by_inductor_match_one_chunk_eager():
    # The whole chunked layer under torch.compile, as test_all_to_all compiles the layer (~90 s of
    # compiling on 2 cores): within 1e-5 of eager, inductor's fusions round otherwise. Worst-case
    # buffers: no host sync, so the one graph without a break at the split sizes.
    run_ranks(worker, 2, "all_to_all", "worst_case", False, False, "inductor", False)


def deep_ep_is_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("deep_ep") is not None
    except (ImportError, ValueError):
        return False


GPU_CASES = [("all_to_all", "exact", False), ("all_to_all", "worst_case", True), ("all_to_all", "exact", "exchange"),
             ("deepep", "exact", False), ("deepep", "worst_case", True), ("deepep", "exact", "exchange")]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind, buffers, use_checkpoint", GPU_CASES)
def test_chunks_match_one_chunk_on_gpus(kind, buffers, use_checkpoint):
    # NCCL all-to-all on its communication stream and the real DeepEP on its own: the exchanges really
    # run beside the experts here. Everything within the fp32 / bf16 tolerances (a GPU GEMM may pick
    # other tiles for another row count: no bitwise claim per token).
    if kind == "deepep" and not deep_ep_is_installed():
        pytest.skip("needs deep_ep (scripts/install_deepep.sh)")
    run_ranks(worker, 2, kind, buffers, use_checkpoint, False, None, True)


class IssueOrder(TorchDispatchMode):
    """The exchanges and expert GEMMs in the order the host issues them, with their row counts."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("exchange", "grouped_mm"):
            first = args[0][0] if name == "exchange" else args[0]
            self.ops.append(f"{name}[{first.shape[0]}]")
        return func(*args, **(kwargs or {}))


def order_worker(rank: int, world: int, port: int, device: str, failures):
    if device == "cuda":
        torch.cuda.set_device(0)
    with rank_group(rank, world, port, failures, "nccl" if device == "cuda" else "gloo"):
        torch.manual_seed(0)
        layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=2, inter_dim=INTER, padding="none"), DIM).to(device)
        layer.init_weights(out_std=0.1)
        layer.set_dispatcher(AllToAllDispatcher(EXPERTS, dist.group.WORLD))
        layer.overlap = "chunks"
        streams = []
        original = dist.all_to_all_single
        cuda = device == "cuda"
        dist.all_to_all_single = lambda *a, **k: streams.append(cuda and torch.cuda.current_stream()) or original(*a, **k)
        try:
            out = layer(torch.randn(1, 21, DIM, device=device, requires_grad=True))  # chunks of 11 and 10 tokens
            with IssueOrder() as issued:
                out.backward(torch.randn_like(out))
        finally:
            dist.all_to_all_single = original
        # Chunk 1's reverse combine, its expert backward (2 GEMMs, 20 rows: 10 tokens x top-2); chunk 0's
        # reverse combine issued after them (on CUDA it runs beside them), its expert backward; then the
        # dispatches' reverse, chunk 1's issued after chunk 0's expert backward, beside which it runs.
        assert issued.ops == ["exchange[10]", "grouped_mm[20]", "grouped_mm[20]", "exchange[11]", "grouped_mm[22]",
                              "grouped_mm[22]", "exchange[10]", "exchange[11]"], issued.ops
        if device == "cuda":  # forward and backward (autograd: its forward's stream) on the communication stream
            from torchtitan_moe.dispatch.all_to_all import _comm_stream

            comm = _comm_stream(torch.device("cuda", 0))
            # All but the two split-size exchanges (one per chunk: their sizes go to the host) run there.
            assert sum(s != comm for s in streams) == 2 and len(streams) > 2, streams


def test_backward_issues_each_reverse_exchange_before_the_other_chunks_expert_backward():
    # The autograd engine runs ready nodes latest-created first: this order is what lets a chunk's
    # reverse exchange run under the other chunk's expert backward on a GPU (docs/dispatchers.md, overlap).
    run_ranks(order_worker, 1, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_backward_exchanges_run_on_the_communication_stream():
    run_ranks(order_worker, 1, "cuda")


def working_copy_worker(rank: int, world: int, port: int, failures):
    # Imported here: the model's module brings torchtitan, which the other workers' processes need not import.
    from torchtitan_moe.models.qwen3_moe.parallelize import keep_experts_unsharded

    with rank_group(rank, world, port, failures):
        results, kept = [], []
        for overlap in ("none", "chunks"):
            torch.manual_seed(0)
            layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="none"), DIM)
            layer.init_weights(out_std=0.1)
            layer.set_dispatcher(AllToAllDispatcher(EXPERTS, dist.group.WORLD))
            layer.overlap = overlap
            keep_experts_unsharded(layer.experts, torch.bfloat16)  # as parallelize leaves a one-rank FSDP group
            w13_shape = tuple(layer.experts.w13.transpose(-2, -1).shape)
            copies = []

            def pack(t, copies=copies, shape=w13_shape):
                if t.dtype == torch.bfloat16 and tuple(t.shape) == shape:
                    copies.append(t.untyped_storage().data_ptr())
                return t

            x = torch.randn(1, 21, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(x)
            out.backward(torch.ones_like(out))
            kept.append(set(copies))
            working = layer.experts.working["w13"].untyped_storage().data_ptr()
            assert kept[-1] == {working}, (kept[-1], working)  # the working copy, no cast of its own
            results.append((out.detach(), x.grad, layer.experts.w13.grad, layer.experts.w2.grad))
        for name, a, b in zip(("out", "dx", "dw13", "dw2"), *results):
            assert_close_to_max(b, a, 2**-7, name)  # bf16 GEMMs over other row counts, two partial sums


def test_chunks_read_one_working_copy_of_the_experts_weights():
    # Experts outside FSDP2: both chunks' GEMMs (forward and backward) read the one working copy, and
    # the results are the unchunked layer's to bf16 rounding.
    run_ranks(working_copy_worker, 1)


def test_split_routing_counts_each_chunk_and_keeps_the_losses_whole():
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, router=RouterOptions(balance_loss="micro_batch", balance_loss_coeff=0.1)), DIM)
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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo parity run")
def test_training_with_chunks_matches_one_chunk(parity_out, forked_launches):
    # The trainer: FSDP2, EP = 2, full activation checkpointing (the recompute replays both chunks'
    # exchanges), exact and worst-case buffers, fp32, one launch. Losses and grad norms within the
    # harness's 1e-5 (fp32 summation order: the experts' weight gradients are two partial sums).
    from torchtitan_moe.tools.parity import main

    code = main([str(ROOT / "configs" / "debug.toml"), "--vary", "dispatch.buffers=exact,worst_case",
                 "--vary", "dispatch.overlap=none,chunks", "--steps", "6", "--nproc", "2", "--out", str(parity_out),
                 "--no-plot", "--one-launch", "--", "--parallelism.expert_parallel_degree", "2",
                 "--activation_checkpoint.mode", "full"])
    report = (parity_out / "parity.md").read_text()
    assert code == 0, report
    assert "| 6 |" in report and report.count("| ok |") == 3, report


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo runs with the fake deep_ep")
def test_training_with_deepep_chunks_matches_one_chunk(parity_out, monkeypatch, forked_launches):
    # The fake DeepEP in the trainer: bf16 FSDP2 mixed precision, full activation checkpointing. In bf16
    # each chunk's expert weight gradient is rounded to bf16 before the two are added (one rounding
    # unchunked): grad norms 2.2e-5 apart after 4 steps, losses 2.5e-6 (measured); within 1e-4.
    from test_deepep import with_fake_on_path

    from torchtitan_moe.tools.parity import main

    with_fake_on_path(monkeypatch)
    code = main([str(ROOT / "configs" / "debug.toml"), "--vary", "dispatch.overlap=none,chunks", "--steps", "4",
                 "--nproc", "2", "--loss-rtol", "1e-4", "--grad-rtol", "1e-4", "--out", str(parity_out), "--no-plot",
                 "--one-launch", "--", "--parallelism.expert_parallel_degree", "2", "--dispatch.backend", "deepep",
                 "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"])
    report = (parity_out / "parity.md").read_text()
    assert code == 0, report
    assert "| 4 |" in report and report.count("| ok |") == 1, report
