"""Op tests run on the GPU where there is one, else under the Triton interpreter on CPU
(tests/conftest.py also skips the `gpu` tests there).

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it
then), hence here, before the test modules are collected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poison_empty(monkeypatch):
    """Fresh torch.empty buffers hold NaN (floats) or -777 (ints) instead of whatever was
    there, so an output element an op forgets to write cannot pass for a right one."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -777)

    monkeypatch.setattr(torch, "empty", poisoned)
