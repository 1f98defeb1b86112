"""Shared by the op tests: error bounds and random routings.

Bounds hold against float64 results computed from the same inputs:
- elementwise results: within `ulps` units in the last place of the output dtype at
  the exact value (1 for bf16/fp16: one rounding of an fp32 result);
- reductions: within sum(|terms|) * REDUCTION_EPS[output dtype] per element, with the
  |terms| summed in float64 by the test.
"""

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
REDUCTION_EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 2**-16, torch.float64: 2**-40}


def ulp(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |exact| (subnormal spacing below the smallest normal)."""
    exponent = torch.floor(torch.log2(exact.double().abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


def _report(name: str, actual: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor) -> None:
    err = (actual.double() - exact).abs()
    bad = ~(err <= tol)  # NaN is bad
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements out of bounds; first at {i}: "
            f"got {actual[tuple(i)].item()!r}, exact {exact[tuple(i)].item()!r}, tol {tol[tuple(i)].item():.3g}"
        )


def assert_ulp(name: str, actual: torch.Tensor, exact: torch.Tensor, ulps: float = 1, slack=0.0) -> None:
    """|actual - exact| <= ulps * ulp(exact) + slack, elementwise."""
    assert actual.shape == exact.shape, (name, actual.shape, exact.shape)
    _report(name, actual, exact, ulps * ulp(exact, actual.dtype) + slack)


def assert_sum(name: str, actual: torch.Tensor, exact: torch.Tensor, abs_terms: torch.Tensor) -> None:
    """|actual - exact| <= sum(|terms|) * REDUCTION_EPS[actual.dtype], elementwise."""
    assert actual.shape == exact.shape, (name, actual.shape, exact.shape)
    _report(name, actual, exact, abs_terms * REDUCTION_EPS[actual.dtype])


def elementwise_ulps(dtype: torch.dtype) -> float:
    """1 ulp for 16-bit outputs (one rounding of fp32); a few for fp32 (exp, divide)."""
    return 16 if dtype == torch.float32 else 1


def random_routing(T: int, K: int, E: int, seed: int, experts_used: int | None = None, empty: float = 0.0):
    """experts [T, K]: K distinct random experts per token among the first `experts_used`
    (all E by default), and a fraction `empty` of the slots set to -1 (no expert)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(T, experts_used or E, generator=g).topk(K, dim=1).indices
    return torch.where(torch.rand(T, K, generator=g) < empty, -1, experts)
