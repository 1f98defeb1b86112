"""What a config asks of this machine (a GPU for Triton kernels, DeepEP for its dispatcher, a readable
tuned file), refused in one line before training starts: the trainer and `tools/check_config` ask it."""

from __future__ import annotations

import os

import torch

from torchtitan_moe.config.sections import ConfigError


def check_machine(config, nproc_per_node: int | None = None) -> None:
    """What the config asks of this machine, refused in one line before training starts."""
    from torchtitan_moe.parallel import tuned
    from torchtitan_moe.dispatch.deepep_backend import DeepEPUnavailable, import_deep_ep

    ours = config.model.name == "qwen3_moe"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if ours and config.kernels.backend == "triton" and not torch.cuda.is_available() and not interpreted:
        raise ConfigError("[kernels] backend = 'triton' needs a CUDA GPU, and this machine has none; "
                          "use 'auto' (Triton on CUDA, torch on CPU) or 'torch'")
    if not ours:
        return
    if config.dispatch.tuned_file:
        tuned.load_named(config.dispatch.tuned_file)  # missing, or not parsing: refused here
    ep = config.parallelism.expert_parallel_degree
    if config.dispatch.backend == "deepep":
        # EP groups are runs of EP consecutive ranks (the innermost mesh dimension, under HSDP too):
        # each stays in one node exactly when EP divides the processes per node.
        if nproc_per_node is not None and nproc_per_node % ep != 0:
            raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} with [dispatch] backend = 'deepep': EP "
                              f"would span nodes ({nproc_per_node} processes per node) and DeepEP's kernels are "
                              "intranode; use backend = 'all_to_all' there, or an EP that divides the GPUs of a node")
        try:
            import_deep_ep()
        except DeepEPUnavailable as e:
            raise ConfigError(f"[dispatch] backend = 'deepep': {e}") from None
