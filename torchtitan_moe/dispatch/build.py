"""Build each MoE layer's dispatcher from [dispatch], [kernels] and [moe]."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_moe.dispatch.local import LocalDispatcher
from torchtitan_moe.moe.layer import MoE, resolve_kernels
from torchtitan_moe.moe.padding import resolve_alignment


def training_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_dispatchers(model: nn.Module, parallel_dims, job_config) -> None:
    """Give every MoE layer of `model` its dispatcher (and, under EP, its expert shard)."""
    device = training_device()
    kernels = resolve_kernels(job_config.kernels.backend, device)
    align = resolve_alignment(job_config.moe.padding, job_config.moe.align, device)
    backend = job_config.dispatch.backend
    if backend == "auto":
        backend = "local" if parallel_dims.ep == 1 else "all_to_all"
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if backend == "local":
            moe.set_dispatcher(LocalDispatcher(moe.num_experts, align=align, kernels=kernels))
        else:
            raise ValueError(f"[dispatch] backend = {backend!r} is not available in this build")
