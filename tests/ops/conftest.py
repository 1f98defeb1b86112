"""Op tests run on the GPU where there is one, else under the Triton interpreter on CPU
(tests/conftest.py also skips the `gpu` tests there).

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it
then), hence here, before the test modules are collected.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _dynamo_knows_torch_empty() -> None:
    # Dynamo records which callables are torch's on first use. Were that first use while
    # torch.empty is patched, a later compile would refuse the real torch.empty ("marked as
    # skipped"): test_compiled_layer_matches_eager failed when run after test_combine alone.
    torch.compile(lambda x: torch.empty(1) + x, backend="eager", fullgraph=True)(torch.zeros(1))


@pytest.fixture
def poison_empty(monkeypatch):
    """Fresh torch.empty buffers hold NaN (floats) or -777 (ints) instead of whatever was
    there, so an output element an op forgets to write cannot pass for a right one."""
    _dynamo_knows_torch_empty()
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -777)

    monkeypatch.setattr(torch, "empty", poisoned)
