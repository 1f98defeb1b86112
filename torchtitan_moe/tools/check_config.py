"""Validate a config without training, before any worker starts:

    python -m torchtitan_moe.tools.check_config FILE [--nproc N [--nproc-per-node G]] [--section.key value ...]

Checks the TOML and overrides, what this machine must have for them (`check_machine`: a GPU
for Triton kernels, DeepEP for its dispatcher, a readable tuned file), what the run will read (its
text data, every file and record; the checkpoint it would load, with its checksums; its dump folder
not held by another live run), builds the model on the meta device and prints its size. `--nproc` is the number of processes the run will have (all
nodes); the parallelism degrees are checked against it, as training would, and a config whose degrees
need several processes is refused without it. `--nproc-per-node` (default: --nproc) bounds DeepEP's
expert parallelism, which stays inside a node.
Exit status 0 when the config can train, 2 with one line naming the problem otherwise.
`scripts/train.sh` and `scripts/slurm_train.sbatch` run it before they launch.
"""

from __future__ import annotations

import sys

import torch

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.train.job_config import load_job_config, run_command
from torchtitan_moe.train.machine import check_machine

USAGE = "usage: python -m torchtitan_moe.tools.check_config FILE [--nproc N [--nproc-per-node G]] [--section.key value ...]"


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


def check_process_counts(config, nproc: int | None, per_node: int | None) -> None:
    """--nproc against --nproc-per-node, and a parallelism that needs several processes against no --nproc."""
    if per_node is not None and nproc is not None:
        if per_node > nproc:
            raise ConfigError(f"--nproc-per-node {per_node}: more than --nproc {nproc} (the processes of all nodes)")
        if nproc % per_node:
            raise ConfigError(f"--nproc {nproc}: not a multiple of --nproc-per-node {per_node} (every node runs "
                              "the same number of processes)")
    if per_node is not None and nproc is None:
        raise ConfigError(f"--nproc-per-node {per_node} without --nproc: pass --nproc N, the processes of all nodes")
    par = config.parallelism
    needs = max(par.expert_parallel_degree, par.data_parallel_replicate_degree,
                par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1))
    if nproc is None and needs > 1:
        raise ConfigError(f"[parallelism] asks for {needs} or more processes (expert_parallel_degree = "
                          f"{par.expert_parallel_degree}, data_parallel_replicate_degree = "
                          f"{par.data_parallel_replicate_degree}, data_parallel_shard_degree = "
                          f"{par.data_parallel_shard_degree}): pass --nproc N, the run's processes, to check them")


def check_what_the_run_reads(config, args, nproc: int | None) -> None:
    """What the run will read and write, checked as its ranks will: the dump folder free of another run, the
    data, and the checkpoint it would load (with its checksums)."""
    from torchtitan_moe.components.data.check import check_text_data
    from torchtitan_moe.train.checkpoint import check_checkpoint_to_load
    from torchtitan_moe.train.run_folder import refuse_if_held

    refuse_if_held(config.job.dump_folder)
    check_text_data(config, args.vocab_size, nproc)
    if config.model.name == "qwen3_moe":
        check_checkpoint_to_load(config, args, nproc)  # FSDP and EP: every process is a data-parallel rank


def check(argv: list[str]) -> str:
    from torchtitan_moe.components.flops import causal_flops_per_token
    from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args

    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    nproc = _take_int(argv, "--nproc")
    per_node = _take_int(argv, "--nproc-per-node")
    config = load_job_config(["--job.config_file", argv[0], *argv[1:]], world_size=nproc)
    check_process_counts(config, nproc, per_node)
    per_node = per_node or nproc
    check_machine(config, per_node)
    args = flavor_args(config.model.flavor)
    args.update_from_config(config)
    check_what_the_run_reads(config, args, nproc)
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    total, flops = args.get_nparams_and_flops(model, config.training.seq_len)
    moe = args.moe
    return (
        f"ok: {config.model.name} {config.model.flavor}: {total / 1e6:,.1f}M parameters, "
        f"{args.n_layers} layers x {moe.num_experts} experts (top-{moe.top_k}), "
        f"{flops / 1e9:,.2f} GFLOP per token (training; causal count "
        f"{causal_flops_per_token(flops, args, config.training.seq_len) / 1e9:,.2f}), "
        f"EP = {config.parallelism.expert_parallel_degree}, "
        f"dispatch = {config.dispatch.backend}, kernels = {config.kernels.backend}"
        + (f", {nproc} processes" if nproc else "")
    )


def main(argv: list[str] | None = None) -> int:
    from torchtitan_moe.compat.torchtitan import init_logger

    init_logger()
    return run_command(check, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
