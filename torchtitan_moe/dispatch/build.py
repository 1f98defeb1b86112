"""Build each MoE layer's dispatcher from [dispatch], [kernels] and [moe].

Under expert parallelism the experts' weights are also split here, on the expert dim over
the `ep` mesh (rank r of EP holds experts [r E/EP, (r+1) E/EP)), before FSDP2 shards them
further over `efsdp`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.moe.layer import MoE


def training_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def shard_experts(moe: MoE, ep_mesh) -> None:
    for name, param in list(moe.experts.named_parameters(recurse=False)):
        moe.experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))


def build_dispatchers(model: nn.Module, parallel_dims, job_config) -> None:
    """Give every MoE layer of `model` its dispatcher (and, under EP, its expert shard).

    Kernels and padding come from each layer's MoEArgs ([kernels], [moe] applied there)."""
    device = training_device()
    backend = job_config.dispatch.backend
    if backend == "auto":
        backend = "local" if parallel_dims.ep == 1 else "all_to_all"
    ep_mesh = parallel_dims.get_mesh("ep") if parallel_dims.ep > 1 else None
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if backend == "local":
            moe.set_dispatcher(moe.local_dispatcher(device))
        elif backend == "all_to_all":
            kernels, align = moe.dispatch_settings(device)
            shard_experts(moe, ep_mesh)
            moe.set_dispatcher(AllToAllDispatcher(moe.num_experts, ep_mesh.get_group(), align=align, kernels=kernels))
        else:
            raise ValueError(f"[dispatch] backend = {backend!r}: expected 'local' or 'all_to_all'")
