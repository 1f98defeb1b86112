"""Which implementation an op runs: backend="triton" (the kernels) or "torch" (the reference).

Imports neither triton nor any kernel module, so backend="torch" works where Triton is absent.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("triton", "torch")
# Read once at import: use_triton runs inside compiled regions, where dynamo refuses find_spec.
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """True for "triton", False for "torch"; raises where the choice cannot run as asked.

    Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (how CI tests the
    kernels). Anything else is an error, never a silent fall back to the torch path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r}: expected one of {', '.join(map(repr, BACKENDS))}")
    if backend == "torch":
        return False
    if not _HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package, which is not installed; use backend='torch'")
    for t in tensors:
        if t.device.type != "cuda" and not (_INTERPRET and t.device.type == "cpu"):
            raise RuntimeError(
                f"backend='triton' got a tensor on {t.device}: it needs CUDA tensors "
                "(or CPU tensors with TRITON_INTERPRET=1); use backend='torch'"
            )
    return True
