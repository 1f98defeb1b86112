"""send_plan and send_meta, both backends, against a plain-python oracle; send_meta's gradient."""

import pytest
import torch

from ops_helpers import random_routing

from torchtitan_moe import ops

BACKENDS = ["triton", "torch"]
CASES = [  # T, K, E, P, experts used
    (37, 8, 128, 2, None),  # no block multiple of tokens; nearly every token on both ranks
    (40, 6, 24, 3, None),  # K and P not powers of 2
    (50, 4, 16, 8, 4),  # every token on rank 0 (experts 0-3): ranks 1-7 get nothing
    (33, 2, 8, 1, None),  # one rank: one row per token
    (0, 4, 8, 2, None),  # no tokens
]


def plan_oracle(experts: torch.Tensor, num_local: int, ep_size: int):
    rank_slots, counts = [], [0] * ep_size
    for row in experts.tolist():
        seen = set()
        for e in row:
            p = e // num_local
            counts[p] += 1
            rank_slots.append(-1 if p in seen else p)
            seen.add(p)
    return torch.tensor(rank_slots, dtype=torch.int64).view(experts.shape), counts


def meta_oracle(row_slot: list[int], experts: torch.Tensor, probs: torch.Tensor, num_local: int) -> torch.Tensor:
    K = experts.shape[1]
    meta = torch.zeros(len(row_slot), 2 * K)
    meta[:, :K] = -1
    for r, s in enumerate(row_slot):
        if s < 0:
            continue
        t, p = s // K, int(experts.view(-1)[s]) // num_local
        for k in range(K):
            if int(experts[t, k]) // num_local == p:
                meta[r, k], meta[r, K + k] = int(experts[t, k]) % num_local, probs[t, k]
    return meta


def send_rows(rank_slots: torch.Tensor, ep_size: int):
    """The dispatcher's send layout, with a tail of -1 rows (as its allocation has)."""
    T, K = rank_slots.shape
    index = ops.routing_index(rank_slots.cpu(), ep_size, num_slots=T * min(K, ep_size), backend="torch")
    return torch.cat([index.row_slot, torch.full((3,), -1)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, K, E, P, used", CASES)
def test_send_plan(T, K, E, P, used, backend, device, poison_empty):
    experts = random_routing(T, K, E, seed=T + K + P, experts_used=used)
    rank_slots, counts = ops.send_plan(experts.to(device), E // P, P, backend=backend)
    want_slots, want_counts = plan_oracle(experts, E // P, P)
    assert rank_slots.dtype == counts.dtype == torch.int64
    assert torch.equal(rank_slots.cpu(), want_slots) and counts.tolist() == want_counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, K, E, P, used", CASES)
def test_send_meta_and_its_gradient(T, K, E, P, used, backend, device, poison_empty):
    experts = random_routing(T, K, E, seed=T * 3 + K + P, experts_used=used)
    g = torch.Generator().manual_seed(T)
    probs = torch.rand(T, K, generator=g)
    row_slot = send_rows(ops.send_plan(experts, E // P, P, backend="torch")[0], P)

    leaf = probs.to(device).requires_grad_()
    meta = ops.send_meta(row_slot.to(device), experts.to(device), leaf, E // P, backend=backend)
    assert meta.dtype == torch.float32 and meta.shape == (row_slot.shape[0], 2 * K)
    assert torch.equal(meta.detach().cpu(), meta_oracle(row_slot.tolist(), experts, probs, E // P))

    # Each slot rides on exactly one row: its prob's gradient is that row's entry, copied exactly.
    dmeta = torch.randn(meta.shape, generator=g)
    meta.backward(dmeta.to(device))
    want = torch.zeros(T, K)
    for r, s in enumerate(row_slot.tolist()):
        if s >= 0:
            t, p = s // K, int(experts.view(-1)[s]) // (E // P)
            for k in range(K):
                if int(experts[t, k]) // (E // P) == p:
                    want[t, k] = dmeta[r, K + k]
    assert torch.equal(leaf.grad.cpu(), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_plan_marks_one_slot_per_token_and_rank(backend, device):
    ranks = torch.tensor([[0, 1, 0, 2], [3, 3, 3, 3], [1, 0, 2, 0]])  # one expert per rank: expert = rank
    first = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    rank_slots, counts = ops.send_plan(ranks.to(device), 1, 4, backend=backend)
    assert torch.equal(rank_slots.cpu(), torch.where(first, ranks, -1)) and counts.tolist() == [4, 2, 2, 4]


def test_send_meta_refuses_bad_arguments():
    experts = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="probs must be float32"):
        ops.send_meta(torch.zeros(4, dtype=torch.int64), experts, torch.zeros(4, 2, dtype=torch.float64), 2, backend="torch")
    with pytest.raises(ValueError, match="experts must be a 2-D integer tensor"):
        ops.send_plan(experts.float(), 2, 2, backend="torch")
    with pytest.raises(ValueError, match="num_local"):
        ops.send_plan(experts, 0, 2, backend="torch")
