"""What a config asks of this machine (a GPU for Triton kernels, DeepEP for its dispatcher, a readable
tuned file), refused in one line before training starts: the trainer and `tools/check_config` ask it."""

from __future__ import annotations

import os

import torch

from torchtitan_moe.config.sections import ConfigError


def check_machine(config, nproc_per_node: int | None = None) -> None:
    """What the config asks of this machine, refused in one line before training starts."""
    from torchtitan_moe.config.sections import dispatch_refusal, dispatch_run, dispatch_unavailable
    from torchtitan_moe.dispatch import registry
    from torchtitan_moe.parallel import tuned

    ours = config.model.name == "qwen3_moe"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if ours and config.kernels.backend == "triton" and not torch.cuda.is_available() and not interpreted:
        raise ConfigError("[kernels] backend = 'triton' needs a CUDA GPU, and this machine has none; "
                          "use 'auto' (Triton on CUDA, torch on CPU) or 'torch'")
    if not ours:
        return
    _refuse_host_memory(config, nproc_per_node or 1)
    if config.dispatch.tuned_file:
        tuned.load_named(config.dispatch.tuned_file)  # missing, or not parsing: refused here
    backend = config.dispatch.backend
    if backend == "auto":
        return
    # EP groups are runs of EP consecutive ranks (the innermost mesh dimension, under HSDP too): each
    # stays in one node exactly when EP divides the processes per node, which are known here.
    run = dispatch_run(config, config.parallelism.expert_parallel_degree, procs_per_node=nproc_per_node)
    refusal = dispatch_refusal(backend, run)
    if refusal:
        raise ConfigError(refusal)
    missing = registry.get(backend).missing
    why = missing() if missing is not None else None
    if why:
        raise ConfigError(dispatch_unavailable(backend, run, why))


def configure_allocator(config) -> None:
    """[training] expandable_segments for CUDA's caching allocator, before the run's first allocation (the
    environment's other allocator options passed again with it; a conflicting one was refused by the config
    check)."""
    if torch.cuda.is_available():
        own = f"expandable_segments:{config.training.expandable_segments}"
        torch.cuda.memory._set_allocator_settings(",".join(filter(None, (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), own))))


HOST_SHARE = 0.75  # of the node's RAM: pinned pages cannot be swapped, and the data and the OS need their share


def offloaded_bytes_per_node(config, nproc_per_node: int) -> int:
    """[activation_checkpoint] offload_inputs: the pinned host memory the node's ranks hold for their blocks'
    inputs at the forward's end (every block's but the last's: in the params' dtype under FSDP2, fp32 in one
    process, where autocast leaves the residual stream in fp32), and with offload_attention their attention's
    outputs (heads x head_dim a token in that dtype) and log-sum-exps (heads a token, fp32)."""
    from torchtitan_moe.models.qwen3_moe import flavor_args

    ac = config.activation_checkpoint
    if not ac.offload_inputs:
        return 0
    args = flavor_args(config.model.flavor)
    tokens = config.training.local_batch_size * config.training.seq_len
    one_process = nproc_per_node == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1
    dtype = torch.float32 if one_process else getattr(torch, config.training.mixed_precision_param)
    per_token = args.dim * dtype.itemsize
    if ac.offload_attention:
        per_token += args.n_heads * (args.head_dim * dtype.itemsize + 4)
    return nproc_per_node * (args.n_layers - 1) * tokens * per_token


def _refuse_host_memory(config, nproc_per_node: int) -> None:
    need = offloaded_bytes_per_node(config, nproc_per_node)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > HOST_SHARE * ram:
        attention = " and its attention outputs" if config.activation_checkpoint.offload_attention else ""
        raise ConfigError(f"[activation_checkpoint] offload_inputs = true pins {need / 2**30:.0f} GiB of host memory "
                          f"on this node ({nproc_per_node} ranks x every block's input but the last's{attention}), over "
                          f"{HOST_SHARE:.0%} of its {ram / 2**30:.0f} GiB: use a smaller local_batch_size or "
                          "offload_inputs = false")
