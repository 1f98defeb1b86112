"""Test-wide setup: run Triton kernels under the interpreter where there is no GPU, and skip
the tests marked `gpu` there.

TRITON_INTERPRET must be set before any kernel module is imported, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
