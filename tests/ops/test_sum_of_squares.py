"""sum_of_squares: the gradients' sum of squares in one pass, against float64 and the foreach reference.

Sizes around the kernel's block (4096) and empty tensors, fp32 and bf16 in one call (a launch per
dtype), NaN and inf reaching the sum (clipping must see them)."""

import pytest
import torch

from torchtitan_moe import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [0, 1, 1000, 4096, 4097, 10000, 3]


def tensors(dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 2).to(DEVICE, dtype) for n, dtype in zip(SIZES, dtypes)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mix", ["float32", "bfloat16", "both"])
def test_sum_of_squares_is_the_float64_sum_of_the_values(mix, backend):
    dtypes = {"float32": [torch.float32] * 7, "bfloat16": [torch.bfloat16] * 7,
              "both": [torch.float32, torch.bfloat16] * 4}[mix]
    ts = tensors(dtypes)
    got = ops.sum_of_squares(ts, backend=backend)
    expected = sum(float(t.double().square().sum()) for t in ts)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == pytest.approx(expected, rel=2e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nan_and_inf_reach_the_sum(backend):
    ts = tensors([torch.bfloat16] * 7)
    ts[4][4096] = float("inf")  # the first element of a tensor's second block
    assert float(ops.sum_of_squares(ts, backend=backend)) == float("inf")
    ts[2][999] = float("nan")
    assert ops.sum_of_squares(ts, backend=backend).isnan()


def test_two_large_tensors_of_different_scales():
    # Every program's partial sum lands in the total once: a lost or doubled block of the small-valued tensor
    # moves the total by far more than the tolerance. (The foreach reference, a norm squared, is off by ~6e-6.)
    g = torch.Generator().manual_seed(1)
    ts = [(torch.randn(64 * 1536 + 5, generator=g) * 30).to(DEVICE, torch.bfloat16),
          torch.randn(70_001, generator=g).to(DEVICE, torch.bfloat16)]
    expected = sum(float(t.double().square().sum()) for t in ts)
    assert float(ops.sum_of_squares(ts)) == pytest.approx(expected, rel=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no tensors"):
        ops.sum_of_squares([])
    with pytest.raises(ValueError, match="tensor 1 must be a float tensor"):
        ops.sum_of_squares([torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    with pytest.raises(ValueError, match="tensor 0 must be contiguous fp32, bf16 or fp16 for backend='triton'"):
        ops.sum_of_squares([torch.zeros(3, 2, device=DEVICE).t()])
    with pytest.raises(ValueError, match="tensor 0 must be contiguous fp32, bf16 or fp16"):
        ops.sum_of_squares([torch.zeros(3, dtype=torch.float64, device=DEVICE)])
    assert float(ops.sum_of_squares([torch.ones(3, dtype=torch.float64)], backend="torch")) == pytest.approx(3.0)
