"""copies_differ: the experts' working-copy check in one pass, against the torch reference and the facts.

Under TRITON_INTERPRET=1 (CPU) the kernel's rounding is round_to's emulation of the GPU's; on a GPU the
same tests run compiled. Sizes around the kernel's block (1024), every copy in a NaN-tailed buffer (a read
past the end would be seen as a difference), one element changed in some copies, rounding ties."""

import pytest
import torch

from torchtitan_moe import ops
from torchtitan_moe.ops.copy_check import copies_differ_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [0, 1, 1000, 1024, 1025, 5000, 3]


def pairs(dtype, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights, copies = [], []
    for n in sizes:
        w = (torch.randn(n, generator=g) * 3).to(DEVICE)
        buffer = torch.full((n + 64,), float("nan"), dtype=dtype, device=DEVICE)
        buffer[:n] = w.to(dtype)
        weights.append(w)
        copies.append(buffer[:n])
    return weights, copies


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_only_the_copies_changed_differ(dtype, backend):
    weights, copies = pairs(dtype)
    assert ops.copies_differ(weights, copies, backend=backend).tolist() == [False] * len(SIZES)
    changed = [2, 4, 5]  # in the first block, just past a block, in the last block
    for i, at in zip(changed, (7, 1024, 4999)):
        bits = copies[i].view(torch.int16)
        bits[at] ^= 1  # one ulp
    expected = [i in changed for i in range(len(SIZES))]
    assert ops.copies_differ(weights, copies, backend=backend).tolist() == expected
    assert copies_differ_reference(weights, copies).tolist() == expected


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_copy_is_current_when_it_is_the_cast_rounded_to_nearest_even(backend):
    # Weights halfway between two bf16 values (ties, to even) and just off them; a truncated copy is stale.
    base = torch.tensor([1.0, 1.0078125, -3.0, 2.0**-130], dtype=torch.float32)
    half_ulp = torch.tensor([2.0**-8, 2.0**-8, 2.0**-7, 2.0**-138], dtype=torch.float32)
    w = torch.cat([base + half_ulp, base + half_ulp * 1.5, base + half_ulp * 0.5, base - half_ulp]).to(DEVICE)
    cast = w.to(torch.bfloat16)
    truncated = (w.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(cast, truncated)
    assert ops.copies_differ([w, w], [cast, truncated], backend=backend).tolist() == [False, True]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nan_weights_match_nan_copies_and_nothing_else(backend):
    w = torch.tensor([float("nan"), 1.0, float("inf"), -0.0], device=DEVICE)
    copy = w.to(torch.bfloat16)
    other_nan = copy.clone()
    other_nan.view(torch.int16)[0] = 0x7FC1  # a NaN with another payload
    not_nan = copy.clone()
    not_nan[0] = 0.0
    plus_zero = copy.clone()
    plus_zero[3] = 0.0  # +0 is not the cast of -0
    assert ops.copies_differ([w] * 4, [copy, other_nan, not_nan, plus_zero], backend=backend).tolist() == [
        False, False, True, True]


def test_one_expert_layer_sized_pair_and_an_empty_list():
    # Two large pairs in one launch (programs of two tensors far apart); no pairs gives no flags.
    weights, copies = pairs(torch.bfloat16, sizes=[64 * 1536 + 17, 2048 * 70])
    copies[1].view(torch.int16)[-1] ^= 0x8000  # the sign of the last element
    assert ops.copies_differ(weights, copies).tolist() == [False, True]
    assert ops.copies_differ([], []).tolist() == []


def test_bad_arguments_are_named():
    w = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="2 weights and 1 copies"):
        ops.copies_differ([w, w], [w.bfloat16()])
    with pytest.raises(ValueError, match="copies must be bfloat16 or float16"):
        ops.copies_differ([w], [w.double()])
    with pytest.raises(ValueError, match="weight 0 must be float32"):
        ops.copies_differ([w.double()], [w.bfloat16()])
    with pytest.raises(ValueError, match=r"copy 0 must match its weight \(\(4,\)"):
        ops.copies_differ([w], [torch.zeros(5, dtype=torch.bfloat16, device=DEVICE)])
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.copies_differ([torch.zeros(4, 2, device=DEVICE).t()], [torch.zeros(2, 4, dtype=torch.bfloat16, device=DEVICE)])
