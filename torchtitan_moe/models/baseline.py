"""torchtitan 0.2.2's own Qwen3-MoE, registered as "torchtitan_qwen3_moe", for side-by-side runs.

Its model, parallelize function (EP, FSDP2, activation checkpointing, compile) and
optimizers exactly as torchtitan ships them, with the shapes of our flavors and our data
and tokenizer, so `bench_train` and the parity harness compare both stacks on the same
tokens. Our [moe], [router], [dispatch], [kernels] and [checks] sections do not apply to
it; its balancing is torchtitan's (the expert bias is kept but, in 0.2.2's Qwen3 spec, never
updated), and `--debug.moe_force_load_balance` is its forced-balance switch.

`[model] init_from = "qwen3_moe"` starts it from the weights our model makes from the same seed
on the same device (our init, mapped to torchtitan's names: `w13 [E, 2I, D]` = `w1 | w3`), so
the two models train from identical weights without a checkpoint; `init_fingerprint` is what the
parity harness compares to check that they do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_moe.components.data import build_dataloader, build_tokenizer
from torchtitan_moe.components.metrics import build_metrics_processor
from torchtitan_moe.models.qwen3_moe import flavor_args
from torchtitan_moe.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.model import Qwen3MoEModel
from torchtitan_moe.components.optimizer import build_optimizers
from torchtitan_moe.compat.torchtitan import (
    TorchtitanMoEArgs,
    TorchtitanQwen3Model,
    TorchtitanQwen3ModelArgs,
    TrainSpec,
    build_cross_entropy_loss,
    build_lr_schedulers,
    get_train_spec,
    register_train_spec,
    torchtitan_parallelize_qwen3,
    use_sum_reductions,
)

NAME = "torchtitan_qwen3_moe"


@dataclass
class BaselineArgs(TorchtitanQwen3ModelArgs):
    ours: Qwen3MoEArgs | None = None  # [model] init_from = "qwen3_moe": the model whose init to copy

    def update_from_config(self, job_config, **kwargs) -> None:
        super().update_from_config(job_config, **kwargs)
        if job_config.data.attention == "document":  # torchtitan's own document masking: flex, from the EOS tokens
            self.attn_type, self.attn_mask_type = "flex", "block_causal"
        if job_config.model.init_from == "qwen3_moe":
            self.ours = flavor_args(job_config.model.flavor)
            self.ours.update_from_config(job_config)


def torchtitan_args(ours: Qwen3MoEArgs) -> BaselineArgs:
    """The torchtitan Qwen3 args with the same shapes as one of our flavors."""
    moe, router = ours.moe, ours.moe.router
    return BaselineArgs(
        dim=ours.dim, n_layers=ours.n_layers, n_heads=ours.n_heads, n_kv_heads=ours.n_kv_heads,
        head_dim=ours.head_dim, vocab_size=ours.vocab_size, norm_eps=ours.norm_eps, rope_theta=ours.rope_theta,
        qk_norm=ours.qk_norm, max_seq_len=ours.max_seq_len, enable_weight_tying=ours.enable_weight_tying,
        moe_enabled=True, moe_inter_dim=moe.inter_dim,
        moe_args=TorchtitanMoEArgs(
            num_experts=moe.num_experts, num_shared_experts=0, top_k=moe.top_k, score_func=router.score_func,
            route_norm=router.route_norm, route_scale=router.route_scale, score_before_experts=False,
        ),
    )


# Wrappers torchtitan's activation checkpointing and compile put in parameter names.
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")


def torchtitan_parameters(model: nn.Module, full: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of either model's parameters in torchtitan's Qwen3 names: ours
    `w13 [E, 2I, D]` -> `w1 [E, I, D]`, `w3 [E, I, D]`. `full`: DTensors gathered (collective)."""
    for name, p in model.named_parameters():
        name = _WRAPPERS.sub("", name)
        if full and isinstance(p, DTensor):
            p = p.full_tensor()
        if name.endswith("moe.experts.w13"):
            inter = p.shape[1] // 2
            yield name[: -len("w13")] + "w1", p[:, :inter]
            yield name[: -len("w13")] + "w3", p[:, inter:]
        else:
            yield name, p


class BaselineModel(TorchtitanQwen3Model):
    """torchtitan's Qwen3 model; with `args.ours` set, its init is our model's (same seed)."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        ours = self.model_args.ours
        if ours is None:
            return super().init_weights(buffer_device=buffer_device)
        super().init_weights(buffer_device=buffer_device)  # its buffers; the weights are replaced
        # Our init draws from [debug] seed alone (Qwen3MoEModel.init_weights), as in our own run.
        copy_our_init(self, ours, self.tok_embeddings.weight.device, buffer_device)


@torch.no_grad()
def copy_our_init(model: nn.Module, ours: Qwen3MoEArgs, device: torch.device, buffer_device) -> None:
    """Initialize our model from its seed on `device` and copy its weights into
    torchtitan's `model` (sharded DTensors take their own shard: no communication)."""
    with torch.device("meta"):
        source = Qwen3MoEModel(ours)
    source.to_empty(device=device)
    source.init_weights(buffer_device)
    weights = dict(torchtitan_parameters(source))
    targets = dict(model.named_parameters())
    names = {_WRAPPERS.sub("", n) for n in targets}
    if names != set(weights):
        raise ValueError(f"init_from = 'qwen3_moe': the two models' weights differ: only ours "
                         f"{sorted(set(weights) - names)[:4]}, only torchtitan's {sorted(names - set(weights))[:4]}")
    for name, p in targets.items():
        w = weights[_WRAPPERS.sub("", name)]
        if isinstance(p, DTensor):
            w = distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(w)
    del source, weights


@torch.no_grad()
def init_fingerprint(model: nn.Module) -> dict[str, list[float]]:
    """{torchtitan name: [sum, sum of squares]} in float64 over each whole weight, for our
    model or torchtitan's: equal fingerprints, equal starting weights (to float64 rounding)."""
    prints = {}
    for name, p in torchtitan_parameters(model, full=True):
        p = p.double()
        prints[name] = [p.sum().item(), p.square().sum().item()]
    return prints


def write_init_fingerprint(model: nn.Module, folder: str) -> None:
    """Every rank computes it (DTensors gather collectively); rank 0 writes it."""
    prints = init_fingerprint(model)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "init_fingerprint.json").write_text(json.dumps(prints, indent=0, sort_keys=True) + "\n")


class _Flavors(Mapping):
    """Fresh args per lookup: torchtitan's Trainer edits the args it is given."""

    def __getitem__(self, name: str) -> BaselineArgs:
        return torchtitan_args(FLAVORS[name])

    def __iter__(self):
        return iter(FLAVORS)

    def __len__(self) -> int:
        return len(FLAVORS)


def _build_dataloader(dp_world_size, dp_rank, tokenizer, job_config):
    return build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, FLAVORS[job_config.model.flavor].vocab_size)


def _parallelize(model, parallel_dims, job_config):
    model = torchtitan_parallelize_qwen3(model, parallel_dims, job_config)
    use_sum_reductions(model)  # no-op on NCCL; gloo (CPU) has no averaging reductions
    return model


def register() -> None:
    try:
        get_train_spec(NAME)
    except ValueError:
        register_train_spec(NAME, TrainSpec(
            model_cls=BaselineModel,
            model_args=_Flavors(),
            parallelize_fn=_parallelize,
            pipelining_fn=None,
            build_optimizers_fn=build_optimizers,
            build_lr_schedulers_fn=build_lr_schedulers,
            build_dataloader_fn=_build_dataloader,
            build_tokenizer_fn=build_tokenizer,
            build_loss_fn=build_cross_entropy_loss,
            build_metrics_processor_fn=build_metrics_processor,  # the same step line and metrics.jsonl
        ))
