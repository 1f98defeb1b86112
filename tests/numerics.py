"""Tolerances for the tests: relative to the largest value of the expected tensor.

An absolute tolerance larger than the values themselves passes a zeroed output; a purely
relative one fails on values near zero that are sums of larger terms. `assert_close_to_max`
bounds every element's error by `rel` times the largest |expected| of the tensor, and
refuses an all-zero expectation (a test that compares zeros proves nothing).
"""

import torch


def assert_close_to_max(actual: torch.Tensor, expected: torch.Tensor, rel: float, name: str = "tensor") -> None:
    """|actual - expected| <= rel * max|expected| elementwise; NaN fails; expected must not be all zero."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    expected = expected.detach().double()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    assert scale > 0, f"{name}: the expected tensor is all zero: the comparison proves nothing"
    err = (actual.detach().double() - expected).abs()
    bad = ~(err <= rel * scale)  # NaN is bad
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements off by more than {rel:g} x max "
                             f"|expected| ({scale:.3g}); first at {i}: got {actual[i].item()!r}, "
                             f"expected {expected[i].item()!r}, max error {float(err.max()):.3g}")
