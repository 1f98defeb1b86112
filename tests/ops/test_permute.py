"""routing_index, both backends, against a plain-python oracle."""

import pytest
import torch

from ops_helpers import random_routing

from torchtitan_moe import ops

BACKENDS = ["triton", "torch"]


def oracle(experts: torch.Tensor, num_experts: int, align: int, num_rows_alloc: int):
    """The layout by hand: each expert's slots in slot order, groups padded, then the tail."""
    T, K = experts.shape
    flat = experts.flatten().tolist()
    slots_of = [[s for s, e in enumerate(flat) if e == x] for x in range(num_experts)]
    counts = [len(slots) for slots in slots_of]
    sizes = counts if align == 1 else [max(-(-c // align) * align, align) for c in counts]
    inv, row_slot, start, offsets = [-1] * (T * K), [-1] * num_rows_alloc, 0, []
    for e, slots in enumerate(slots_of):
        for i, s in enumerate(slots):
            inv[s], row_slot[start + i] = start + i, s
        start += sizes[e]
        offsets.append(start)
    return counts, offsets, torch.tensor(inv).view(T, K), row_slot, start


def check(experts, num_experts, align, backend, device, num_slots=None):
    T, K = experts.shape
    N = (T * K if num_slots is None else num_slots) + (0 if align == 1 else num_experts * align)
    got = ops.routing_index(experts.to(device), num_experts, align, num_slots=num_slots, backend=backend)
    counts, offsets, inv, row_slot, num_rows = oracle(experts, num_experts, align, N)
    assert got.top_k == K
    assert got.tokens_per_expert.dtype == torch.int64 and got.tokens_per_expert.tolist() == counts
    assert got.offsets.dtype == torch.int32 and got.offsets.tolist() == offsets
    assert got.inv.dtype == torch.int64 and torch.equal(got.inv.cpu(), inv)
    assert got.row_slot.dtype == torch.int64 and got.row_slot.tolist() == row_slot
    assert got.num_rows.dim() == 0 and got.num_rows.dtype == torch.int64 and got.num_rows.item() == num_rows
    assert got.inv.device.type == got.num_rows.device.type == torch.device(device).type


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("align", [1, 8, 16, 32])
@pytest.mark.parametrize(
    "T, K, E, used",
    [
        (37, 4, 8, None),  # slot count that is no block multiple
        (300, 8, 128, None),  # E = 128: several blocks, most experts see few slots
        (64, 2, 16, 5),  # 11 experts without tokens
        (50, 1, 6, 1),  # one expert takes every token
        (1, 3, 3, None),
        (0, 2, 4, None),  # no tokens at all
    ],
)
def test_routing_index(T, K, E, used, align, backend, device, poison_empty):
    check(random_routing(T, K, E, seed=T * 100 + K, experts_used=used), E, align, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("align", [1, 16])
def test_empty_slots(align, backend, device, poison_empty):
    """-1 slots (a dispatcher's tokens that visit fewer than K experts here) get no row."""
    experts = random_routing(90, 4, 10, seed=7, empty=0.4)
    experts[3] = -1  # a token with no expert at all
    check(experts, 10, align, backend, device)
    check(experts, 10, align, backend, device, num_slots=int((experts >= 0).sum()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_outside_the_experts_are_no_expert(backend, device, poison_empty):
    """Both backends take an id outside [0, E) as they take -1 (the contract is [0, E) or -1, not checked)."""
    experts = random_routing(40, 4, 10, seed=11)
    experts[::3, 0], experts[1::5, 2], experts[2] = 10, 13, -5
    check(experts, 10, 8, backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_experts(backend, device):
    experts = random_routing(20, 2, 4, seed=3)
    a = ops.routing_index(experts.int().to(device), 4, backend=backend)
    b = ops.routing_index(experts.to(device), 4, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(a[:5], b[:5]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(experts=torch.zeros(4, 2)), "experts"),
        (dict(experts=torch.zeros(8, dtype=torch.long)), "experts"),
        (dict(num_experts=0), "num_experts"),
        (dict(align=4), "align"),
        (dict(num_slots=9), "num_slots"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(experts=torch.zeros(4, 2, dtype=torch.long), num_experts=3) | kwargs
    with pytest.raises(ValueError, match=match):
        ops.routing_index(args.pop("experts"), args.pop("num_experts"), **args)


def test_triton_on_cpu_without_interpreter(monkeypatch):
    from torchtitan_moe.ops import _backend

    monkeypatch.setattr(_backend, "_INTERPRET", False)  # TRITON_INTERPRET is read once, at import
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.routing_index(torch.zeros(4, 2, dtype=torch.long), 3, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("T", [16384, 65536])
def test_gpu_matches_torch_and_is_deterministic(T, align):
    experts = random_routing(T, 8, 128, seed=T).cuda()
    experts[:: 97, 3] = -1
    first = ops.routing_index(experts, 128, align, backend="triton")
    again = ops.routing_index(experts, 128, align, backend="triton")
    torch_ = ops.routing_index(experts, 128, align, backend="torch")
    for name, a, b, c in zip(ops.RoutingIndex._fields, first, again, torch_):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{name}: two triton runs differ"
            assert torch.equal(a, c), f"{name}: triton and torch differ"
