"""Build each MoE layer's dispatcher from [dispatch], [kernels] and [moe].

Under expert parallelism the experts' weights are also split here, on the expert dim over
the `ep` mesh (rank r of EP holds experts [r E/EP, (r+1) E/EP)), before FSDP2 shards them
further over `efsdp`. Which dispatcher, and why, is decided once (parallel/choose.py) and
logged; dispatch/registry.py builds it: what its layers share (DeepEP's buffer, the all-gather
transport) once, then one dispatcher per layer.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan_moe.config.sections import ConfigError, dispatch_run, dispatch_unavailable
from torchtitan_moe.dispatch import registry
from torchtitan_moe.dispatch.seam import Unavailable
from torchtitan_moe.moe.layer import MoE
from torchtitan_moe.parallel.choose import choose_dispatcher
from torchtitan_moe.parallel.tuned import Shape

logger = logging.getLogger(__name__)


def training_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_sms(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def shard_experts(moe: MoE, ep_mesh) -> None:
    for name, param in list(moe.experts.named_parameters(recurse=False)):
        moe.experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))


def run_shape(moe: MoE, job_config, ep: int, device: torch.device) -> Shape:
    """This run's key in the tuned dispatcher table."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tokens = job_config.training.local_batch_size * job_config.training.seq_len
    return Shape(gpu, ep, moe.experts.w13.shape[-1], moe.args.top_k, moe.num_experts, tokens)


def build_dispatchers(model: nn.Module, parallel_dims, job_config) -> None:
    """Give every MoE layer of `model` its dispatcher (and, under EP, its expert shard).

    Kernels and padding come from each layer's MoEArgs ([kernels], [moe] applied there)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return
    device = training_device()
    ep = parallel_dims.ep
    ep_mesh = parallel_dims.get_mesh("ep") if ep > 1 else None
    group = ep_mesh.get_group() if ep_mesh is not None else None
    shape = run_shape(moes[0], job_config, ep, device)
    choice = choose_dispatcher(job_config, shape, group, device_sms(device))
    logger.info(f"[dispatch] {choice.reason}")
    run = dispatch_run(job_config, ep, gpus=device.type == "cuda")
    try:
        layer_dispatcher = registry.get(choice.backend).builder(run, group, device, choice.settings, shape.hidden)
    except Unavailable as e:  # e.g. the all-gather's copy-engine transport: no symmetric memory here
        raise ConfigError(dispatch_unavailable(choice.backend, run, e)) from None
    for moe in moes:
        kernels, align = moe.dispatch_settings(device)
        if ep_mesh is not None:
            moe.overlap = job_config.dispatch.overlap
            shard_experts(moe, ep_mesh)
        moe.set_dispatcher(layer_dispatcher(moe.num_experts, align, kernels))
