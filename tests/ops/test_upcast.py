"""upcast: the experts' weight gradients from bf16 to fp32, both backends: the exact values (widening is exact:
compared bit for bit with torch's cast), x's strides kept, sizes that are not a multiple of the kernel's block,
NaN, infinities, signed zeros and subnormals carried, and one clear error for what it does not take."""

import pytest
import torch

from torchtitan_moe import ops

BACKENDS = ["triton", "torch"]


def special_values(dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, info.tiny, info.tiny / 4, -info.max,
                         info.max, info.eps], dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, transposed", [((3, 1000, 7), False), ((4, 96, 64), True), ((0, 5), False),
                                               ((4097,), False)])
def test_upcast_is_the_exact_fp32_value_with_the_strides_of_x(backend, shape, transposed, device):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 1e3).to(dtype)
    if x.numel() >= 10:
        x.view(-1)[:10] = special_values(dtype)
    x = x.to(device)
    if transposed:  # the experts' gradient of a transposed view: dense, not contiguous
        x = x.transpose(-2, -1)
    out = ops.upcast(x, backend=backend)
    assert out.dtype == torch.float32 and out.shape == x.shape and out.stride() == x.stride()
    expected = x.to(torch.float32)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), "not the bits of torch's cast"


@pytest.mark.parametrize("bad, message", [
    (lambda d: torch.zeros(4, 4, device=d), "upcast: x must be bfloat16, got torch.float32"),
    (lambda d: torch.zeros(4, 4, dtype=torch.float16, device=d), "upcast: x must be bfloat16, got torch.float16"),
    (lambda d: torch.zeros(4, 8, dtype=torch.bfloat16, device=d)[:, ::2], "upcast: x must be dense"),
    (lambda d: torch.zeros(1, 8, dtype=torch.bfloat16, device=d).expand(4, 8), "upcast: x must be dense"),
])
def test_upcast_refuses_what_it_cannot_copy_flat(bad, message, device):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ops.upcast(bad(device))
