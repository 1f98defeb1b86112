"""dispatch.exchange: the all-to-all custom op, eager and under torch.compile, forward and backward.

The regression this guards: an all_to_all inside an autograd.Function, traced by dynamo,
gave wrong gradients on NCCL (every gradient of an EP = 2 layer off by a relative 1.0).
Each rank sends rank-tagged rows with uneven splits (one of them empty); the received rows
and the gradients that come back are checked against their known values, eager and
compiled (aot_eager and inductor), on gloo here and on NCCL with 2 GPUs.
"""

import os

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch.exchange import exchange, replay

D = 8


def splits(rank: int, world: int) -> tuple[list[int], list[int]]:
    """Rank r sends (r + p) % 3 rows to rank p: uneven, and some are 0."""
    send = [(rank + p) % 3 for p in range(world)]
    recv = [(p + rank) % 3 for p in range(world)]
    return send, recv


def step(fn, rank, world, device, group):
    send, recv = splits(rank, world)
    # Row j sent to rank p holds 100 * rank + 10 * p + j: the receiver can tell where it came from.
    rows = torch.cat([100 * rank + 10 * p + torch.arange(n, dtype=torch.float32) for p, n in enumerate(send)])
    x = rows[:, None].repeat(1, D).to(device).requires_grad_()
    meta = (rows[:, None] * 2).to(device).requires_grad_()
    y, m = fn(x, meta, send, recv, group)
    weights = torch.arange(1, y.shape[0] + 1, dtype=torch.float32, device=device)[:, None]
    ((y * weights).sum() + (m * weights).sum() * 3).backward()
    return y.detach(), m.detach(), x.grad, meta.grad, send, recv


def plain(x, meta, send, recv, group):
    return exchange([x, meta], send, recv, group)


def check(rank, world, device, group, fn):
    y, m, dx, dmeta, send, recv = step(fn, rank, world, device, group)
    expected = torch.cat([100 * p + 10 * rank + torch.arange(n, dtype=torch.float32) for p, n in enumerate(recv)])
    torch.testing.assert_close(y.cpu(), expected[:, None].repeat(1, D), rtol=0, atol=0)
    torch.testing.assert_close(m.cpu(), 2 * expected[:, None], rtol=0, atol=0)
    # Received row i gets gradient weights[i] = i + 1 (3 * (i + 1) for meta), and it goes back
    # to its sender: my row j to rank p sits in p's receive buffer after the rows of ranks < me.
    expect_dx = []
    for p, n in enumerate(send):
        offset = sum(splits(q, world)[0][p] for q in range(rank))
        expect_dx.append(offset + 1 + torch.arange(n, dtype=torch.float32, device=device))
    expect_dx = torch.cat(expect_dx)
    torch.testing.assert_close(dx, expect_dx[:, None].repeat(1, D), rtol=0, atol=0)
    torch.testing.assert_close(dmeta, 3 * expect_dx[:, None], rtol=0, atol=0)


def worker(rank, world, port, backend, failures):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    with rank_group(rank, world, port, failures, backend):
        group = dist.group.WORLD
        check(rank, world, device, group, plain)
        for compiler in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            check(rank, world, device, group, torch.compile(plain, backend=compiler, fullgraph=True))

        # Replay (activation checkpointing): no communication forward, the same gradients back.
        first = step(plain, rank, world, device, group)
        calls = []
        original = dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            again = step(lambda x, m, s, r, g: replay([x, m], [first[0], first[1]], s, r, g), rank, world, device, group)
        finally:
            dist.all_to_all_single = original
        assert len(calls) == 2, f"replay made {len(calls)} all_to_all calls, expected 2 (the backward only)"
        for a, b in zip(first[:4], again[:4]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    os._exit(0)  # skip interpreter teardown, where gloo can abort a finished process (train.exit_process)


def test_exchange_gloo():
    run_ranks(worker, 2, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_exchange_nccl():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run_ranks(worker, 2, "nccl")
