"""The all-gather dispatcher's own: its messages, the tokens sent before the router, uneven batches refused;
its transport's two calls against their definition (the copy-engine transport on 2 GPUs); training to the bit
as all_to_all. Against the local dispatcher, with the others: tests/test_dispatchers.py."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import rank_group, run_ranks
from test_all_to_all import DIM, EXPERTS, forward_backward, make_layer
from torchtitan_moe.dispatch.all_gather import AllGatherDispatcher, build_transport
from torchtitan_moe.dispatch.peer_memory import CollectiveTransport, PeerMemoryTransport, sum_in_rank_order
from torchtitan_moe.tools.parity import main as parity

ROOT = Path(__file__).resolve().parents[1]

def count_calls(transport) -> list:
    """Each message the transport starts appends its kind (the whole calls start one each)."""
    calls: list = []
    for name in ("all_gather", "reduce_scatter"):
        original = getattr(transport, f"start_{name}")
        setattr(transport, f"start_{name}", lambda arg, _f=original, _n=name: calls.append(_n) or _f(arg))
    return calls


def calls_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        torch.manual_seed(100 + rank)
        x, grad = torch.randn(2, 7, DIM), torch.randn(2, 7, DIM)
        for use_checkpoint in (False, True):
            layer = make_layer("none", False)
            mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
            for name in ("w13", "w2"):
                setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
            transport = build_transport(dist.group.WORLD, torch.device("cpu"))
            calls = count_calls(transport)
            dispatcher = AllGatherDispatcher(EXPERTS, transport)
            dispatcher.keep_exchanges = use_checkpoint
            layer.set_dispatcher(dispatcher)
            forward_backward(layer, x, grad, use_checkpoint)
            assert calls == ["all_gather", "all_gather", "reduce_scatter", "all_gather", "reduce_scatter"], calls


def test_the_tokens_travel_once_and_a_recompute_replays():
    # Forward: the tokens' all-gather (sent by send_tokens, before the router: start_dispatch takes it), the
    # routing's, the partial sums' reduce-scatter; backward: the adjoints of the first and last. A checkpointed
    # recompute replays its three. (Against the local dispatcher: tests/test_dispatchers.py.)
    run_ranks(calls_worker, 2)


def transport_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        transport = CollectiveTransport(dist.group.WORLD)
        torch.manual_seed(rank)
        a, b = torch.randn(3, 4).to(torch.bfloat16), torch.randint(0, 9, (3, 2))
        ga, gb = transport.all_gather([a, b])
        everyone = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(everyone, a)
        assert torch.equal(ga, torch.cat(everyone)) and gb.shape == (3 * world, 2) and gb.dtype == b.dtype
        # Reduce-scatter: rank r gets rows [r T, (r + 1) T) of every rank's tensor, summed in fp32, rounded once.
        c = torch.randn(2 * world, 5).to(torch.bfloat16)
        (got,) = transport.reduce_scatter([c])
        parts = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(parts, c)
        mine = [p[2 * rank:2 * rank + 2] for p in parts]
        expected = sum(p.double() for p in mine).to(torch.bfloat16)
        assert torch.equal(got, expected), (got, expected)


def test_collective_transport_gathers_and_sums_in_rank_order():
    run_ranks(transport_worker, 2, )


def test_sum_in_rank_order_rounds_once():
    # 1 + 2^-8 + 2^-8 in bf16: rounded after each add it stays 1 (ties to even); summed in fp32, 1 + 2^-7.
    parts = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8], dtype=torch.bfloat16),
             torch.tensor([2.0**-8], dtype=torch.bfloat16)]
    assert sum_in_rank_order(parts).item() == 1 + 2.0**-7
    assert sum_in_rank_order(parts[:2]).item() == 1.0  # two parts: one fp32 add, one rounding


def uneven_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        layer = make_layer("none", False)
        layer.set_dispatcher(AllGatherDispatcher(EXPERTS, build_transport(dist.group.WORLD, torch.device("cpu"))))
        with pytest.raises(ValueError, match=r"the EP ranks have \[14, 12\] tokens in this layer"):
            layer(torch.randn(2, 7 - rank, DIM))  # rank 1 has a shorter batch


def other_tokens_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        layer = make_layer("none", False)
        dispatcher = AllGatherDispatcher(EXPERTS, build_transport(dist.group.WORLD, torch.device("cpu")))
        tokens = torch.randn(14, DIM)
        routing = layer.router(tokens)
        dispatcher.send_tokens(tokens)
        with pytest.raises(RuntimeError, match="other tokens than send_tokens sent"):
            dispatcher.start_dispatch(tokens.clone(), routing)
        # Without send_tokens (tune_dispatch, the benchmarks) start_dispatch sends the tokens itself.
        batch = dispatcher.start_dispatch(tokens, routing).wait()
        assert int(batch.num_rows) >= int(batch.tokens_per_expert.sum()) > 0


def test_start_dispatch_takes_the_tokens_send_tokens_sent():
    run_ranks(other_tokens_worker, 2)


def test_uneven_tokens_over_ranks_are_one_error_on_every_rank():
    run_ranks(uneven_worker, 2)


def test_training_with_all_gather_matches_all_to_all_to_the_bit(parity_out):
    # bf16 FSDP2 mixed precision, EP = 2, gloo: each rank's experts see the same rows in the same order and
    # the two ranks' partial sums are added in the same order, so the losses and grad norms are the same bits;
    # with activation checkpointing the recompute replays the kept exchanges (the same bits again). Every
    # setting against all-to-all without checkpointing, in one launch from the session's seed checkpoint.
    code = parity([str(ROOT / "configs" / "debug.toml"), "--vary", "dispatch.backend=all_to_all,all_gather",
                   "--vary", "activation_checkpoint.mode=none,full", "--steps", "3", "--nproc", "2",
                   "--out", str(parity_out), "--no-plot", "--one-launch", "--",
                   "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"])
    report = (parity_out / "parity.md").read_text()
    assert code == 0, report
    for name in ("backend=all_gather,mode=none", "backend=all_to_all,mode=full", "backend=all_gather,mode=full"):
        assert f"| {name} | 0.00e+00 | 0.00e+00 | 0.00e+00 | 0.00e+00 | = | ok |" in report, (name, report)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the copy-engine transport needs 2 GPUs")


def peer_worker(rank, world, port, failures):
    torch.cuda.set_device(rank)
    with rank_group(rank, world, port, failures, "nccl"):
        peer = PeerMemoryTransport(dist.group.WORLD)
        reference = CollectiveTransport(dist.group.WORLD)
        torch.manual_seed(rank)
        # More messages than slots (the senders wait for the slots' release), a larger one halfway (the
        # inbox made anew), mixed dtypes, tensors freed and their memory reused between calls.
        for step, rows in enumerate([64, 64, 8, 64, 512, 512, 64, 512, 8, 512]):
            x = torch.randn(rows, 96, device="cuda").to(torch.bfloat16)
            ids = torch.randint(-1, 8, (rows, 3), device="cuda")
            probs = torch.rand(rows, 3, device="cuda")
            got = [g.clone() for g in peer.all_gather([x, ids, probs])]
            for a, b, name in zip(got, reference.all_gather([x, ids, probs]), ("x", "ids", "probs")):
                assert torch.equal(a, b), f"rank {rank}, message {step}: all_gather {name}"
            y, p = torch.randn(2 * rows, 96, device="cuda").to(torch.bfloat16), torch.randn(2 * rows, 3, device="cuda")
            for a, b, name in zip(peer.reduce_scatter([y, p]), reference.reduce_scatter([y, p]), ("y", "p")):
                assert torch.equal(a, b), f"rank {rank}, message {step}: reduce_scatter {name}"
            del x, ids, probs, y, p
        # The copies ran on copy engines: no kernel on the device while they moved the rows (the first
        # call of this size makes the inbox anew, with kernels: not profiled).
        x = torch.randn(4096, 2048, device="cuda").to(torch.bfloat16)
        peer.all_gather([x])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            peer.all_gather([x])
            torch.cuda.synchronize()
        ops = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
        assert ops and all(name.startswith("Memcpy") for name in ops), ops


@pytest.mark.gpu
@two_gpus
def test_copy_engine_transport_matches_collectives():
    run_ranks(peer_worker, 2)


@pytest.mark.gpu
@two_gpus
def test_training_with_all_gather_matches_deepep_and_all_to_all_on_gpus(tmp_path):
    # Triton kernels, bf16, NCCL and the copy engines: the same rows in the same order on each rank's experts.
    backends = "all_to_all,all_gather" + (",deepep" if importlib.util.find_spec("deep_ep") else "")
    code = parity([str(ROOT / "configs" / "debug.toml"), "--vary", f"dispatch.backend={backends}",
                   "--steps", "6", "--nproc", "2", "--out", str(tmp_path), "--no-plot", "--one-launch", "--",
                   "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16",
                   "--kernels.backend", "triton", "--dispatch.buffers", "worst_case"])
    report = (tmp_path / "parity.md").read_text()
    print(report)
    assert code == 0, report
    assert "| backend=all_gather | 0.00e+00 | 0.00e+00 | 0.00e+00 | 0.00e+00 | = | ok |" in report, report
