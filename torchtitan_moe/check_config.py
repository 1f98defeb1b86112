"""Validate a config without training, before any worker starts:

    python -m torchtitan_moe.check_config FILE [--nproc N [--nproc-per-node G]] [--section.key value ...]

Checks the TOML and overrides, what this machine must have for them (`check_machine`: a GPU
for Triton kernels, DeepEP for its dispatcher, a readable tuned file), builds the model on the
meta device and prints its size. `--nproc` is the number of processes the run will have (all
nodes); the parallelism degrees are checked against it, as training would. `--nproc-per-node`
(default: --nproc) bounds DeepEP's expert parallelism, which stays inside a node.
Exit status 0 when the config can train, 2 with one line naming the problem otherwise.
`scripts/train.sh` and `scripts/slurm_train.sbatch` run it before they launch.
"""

from __future__ import annotations

import os
import sys

import torch

from torchtitan_moe.config import ConfigError
from torchtitan_moe.config_loader import load_job_config, run_command

USAGE = "usage: python -m torchtitan_moe.check_config FILE [--nproc N [--nproc-per-node G]] [--section.key value ...]"


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


def _take_int(argv: list[str], flag: str) -> int | None:
    """Remove `flag N` (or `flag=N`) from argv; N must be a positive integer."""
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in arg else 2)]
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"{flag} {text!r}: must be a number of processes >= 1")
            return int(text)
    return None


def check(argv: list[str]) -> str:
    from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args

    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    nproc = _take_int(argv, "--nproc")
    per_node = _take_int(argv, "--nproc-per-node") or nproc
    config = load_job_config(["--job.config_file", argv[0], *argv[1:]], world_size=nproc)
    check_machine(config, per_node)
    args = flavor_args(config.model.flavor)
    args.update_from_config(config)
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    total, flops = args.get_nparams_and_flops(model, config.training.seq_len)
    moe = args.moe
    return (
        f"ok: {config.model.name} {config.model.flavor}: {total / 1e6:,.1f}M parameters, "
        f"{args.n_layers} layers x {moe.num_experts} experts (top-{moe.top_k}), "
        f"{flops / 1e9:,.2f} GFLOP per token (training), EP = {config.parallelism.expert_parallel_degree}, "
        f"dispatch = {config.dispatch.backend}, kernels = {config.kernels.backend}"
        + (f", {nproc} processes" if nproc else "")
    )


def main(argv: list[str] | None = None) -> int:
    from torchtitan_moe.torchtitan_compat import init_logger

    init_logger()
    return run_command(check, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
