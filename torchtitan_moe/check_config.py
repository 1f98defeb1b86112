"""Validate a config without training: `python -m torchtitan_moe.check_config FILE [overrides]`.

Checks the TOML and overrides, builds the model on the meta device and prints its size.
Exit status 0 when the config can train, 2 with one line naming the problem otherwise.
"""

from __future__ import annotations

import sys

import torch

from torchtitan_moe.config import ConfigError
from torchtitan_moe.config_loader import load_job_config


def check(argv: list[str]) -> str:
    from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args

    if not argv or argv[0].startswith("-"):
        raise ConfigError("usage: python -m torchtitan_moe.check_config FILE [--section.key value ...]")
    config = load_job_config(["--job.config_file", argv[0], *argv[1:]])
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
    )


def main(argv: list[str] | None = None) -> int:
    from torchtitan_moe.torchtitan_compat import init_logger

    init_logger()
    try:
        print(check(list(sys.argv[1:] if argv is None else argv)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
