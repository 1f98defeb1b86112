"""Test-wide setup: run Triton kernels under the interpreter where there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
