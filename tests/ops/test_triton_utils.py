"""round_to, the one rounding every kernel stores through: a cast's bits (to nearest, ties to even).

On a GPU it is Triton's cast; under TRITON_INTERPRET=1 an emulation, since the interpreter's own cast
truncates and loses subnormals. Either way its bf16 must be torch's cast of the same fp32 values."""

import pytest
import torch
import triton
import triton.language as tl

from torchtitan_moe.ops._triton_utils import round_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs, mask=offs < n), tl.bfloat16), mask=offs < n)


def test_round_to_bf16_is_torchs_cast_for_ties_subnormals_and_infinities():
    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    values = [1.0 + ulp / 2, 1.0 + 3 * ulp / 2, 1.0 + ulp / 2 + 2.0**-20, -(2.0 + ulp), 1.0 + ulp / 4,
              2.0**-130, 2.0**-130 + 2.0**-138, 1e-39, -7.3e-40, 2.0**-149,  # subnormals, the smallest one
              3.39e38, 3.4e38, float("inf"), -float("inf"), 0.0, -0.0]
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    y = torch.empty(len(values), dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, len(values), BLOCK=32)
    assert y.view(torch.int16).tolist() == x.to(torch.bfloat16).view(torch.int16).tolist()


def test_round_to_keeps_nan():
    x = torch.tensor([float("nan"), -float("nan")], device=DEVICE)
    y = torch.zeros(2, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, 2, BLOCK=2)
    assert y.isnan().all()
