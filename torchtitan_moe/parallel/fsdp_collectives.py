"""FSDP2's all-gathers and reduce-scatters on the GPUs' copy engines ([parallelism] fsdp_collectives).

FSDP2 runs its collectives as NCCL kernels on a stream of its own. At EP = 2 on 2 GPUs the ranks wait for each
other at every MoE exchange, and an all-gather started on the rank that is ahead spins until the other joins,
holding its SMs (24 CTAs on an H200): a persistent grouped GEMM started beside it cannot place the CTAs those
SMs would take and runs a second wave (worklogs/2026-11-26-session5-h200x2.md; in a profile of this session's
step, rank 0's grouped GEMMs started beside an all-gather took 1.9 ms against 0.7 alone). Here the same calls
move their bytes with device copies into the other GPUs' symmetric memory (dispatch/peer_memory.py), on the copy
engines: no SM is held while waiting. The only kernels left are the reduce-scatter's fp32 sum of the parts and
the copies out of the inbox.

    all-gather      our part is already in FSDP2's output (its copy-in); push it to every peer's inbox, wait
                    for theirs, copy them into the output
    reduce-scatter  push each peer's part of the gradients, wait for ours from them, sum in rank order

With two ranks the sums are NCCL's, bit for bit (a + b, one fp32 rounding, whichever rank adds); the gathered
parameters are copies. FSDP2's hooks (torch >= 2.9: `set_custom_all_gather`, `set_custom_reduce_scatter`) call
these on its all-gather and reduce-scatter streams; reductions are plain sums (`set_force_sum_reduction_for_comms`,
the divide factor 1: the loss is already a mean over the global batch). One transport of its own: its slots are
released on the streams FSDP2 calls on, apart from the MoE dispatcher's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from torchtitan_moe.config import ConfigError

KEY = "[parallelism] fsdp_collectives"


def _comm_bases():
    """FSDP2's comm interfaces (a private module of torch: imported here only)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def make_comms(transport):
    """FSDP2 all-gather and reduce-scatter objects over `transport` (PeerMemoryTransport; CollectiveTransport
    in the CPU tests)."""
    all_gather_base, reduce_scatter_base = _comm_bases()

    class TransportAllGather(all_gather_base):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            transport.all_gather_into(output_tensor, input_tensor)
            return None  # finished on the calling stream: FSDP2 waits for its event

    class TransportReduceScatter(reduce_scatter_base):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op != dist.ReduceOp.SUM:
                raise ValueError(f"{KEY} = 'copy_engines' sums gradients only, FSDP2 asked for {op}")
            transport.reduce_scatter_into(output_tensor, input_tensor)
            return None

    return TransportAllGather(), TransportReduceScatter()


def install(model: torch.nn.Module, transport) -> int:
    """Every FSDP2 module of `model` all-gathers and reduce-scatters through `transport`, with plain sums.
    Returns how many modules it set."""
    all_gather, reduce_scatter = make_comms(transport)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_force_sum_reduction_for_comms(True)
    return len(modules)


def use_copy_engines(model: torch.nn.Module, dp_mesh) -> None:
    """[parallelism] fsdp_collectives = 'copy_engines': FSDP2's collectives over `dp_mesh` (1-D, CUDA, one node
    with peer access) on the copy engines. One clear error where that cannot hold."""
    from torchtitan_moe.dispatch.peer_memory import PeerMemoryTransport, PeerMemoryUnavailable

    if dp_mesh.device_type != "cuda":
        raise ConfigError(f"{KEY} = 'copy_engines' moves FSDP2's collectives between CUDA GPUs, this run is on "
                          f"{dp_mesh.device_type}: use 'default'")
    if dp_mesh.ndim != 1:
        raise ConfigError(f"{KEY} = 'copy_engines' takes a 1-D FSDP mesh (one node), got {dp_mesh.ndim}-D "
                          f"{dp_mesh.mesh_dim_names} (HSDP): use 'default'")
    try:
        transport = PeerMemoryTransport(dp_mesh.get_group(), slots=2)
    except PeerMemoryUnavailable as e:
        raise ConfigError(f"{KEY} = 'copy_engines': {e}; use 'default'") from None
    install(model, transport)
