"""Qwen3-MoE registered with torchtitan as the TrainSpec "qwen3_moe"."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from torchtitan_moe.components.data import build_dataloader, build_tokenizer
from torchtitan_moe.components.metrics import build_metrics_processor
from torchtitan_moe.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.model import Qwen3MoEModel
from torchtitan_moe.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import Qwen3MoEStateDictAdapter
from torchtitan_moe.moe.balance import register_balancing_hook
from torchtitan_moe.components.optimizer import build_optimizers
from torchtitan_moe.compat.torchtitan import (
    TrainSpec,
    build_cross_entropy_loss,
    build_lr_schedulers,
    get_train_spec,
    register_train_spec,
)

NAME = "qwen3_moe"
__all__ = ["FLAVORS", "NAME", "Qwen3MoEArgs", "Qwen3MoEModel", "flavor_args", "register"]


def flavor_args(name: str) -> Qwen3MoEArgs:
    """A copy of a flavor's args, free to edit (`update_from_config` does)."""
    return copy.deepcopy(FLAVORS[name])


class _Flavors(Mapping):
    """FLAVORS, handing out copies: torchtitan's Trainer edits the args it is given."""

    def __getitem__(self, name: str) -> Qwen3MoEArgs:
        return flavor_args(name)

    def __iter__(self):
        return iter(FLAVORS)

    def __len__(self) -> int:
        return len(FLAVORS)


def build_optimizers_with_balancing(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    loss_mesh = parallel_dims.get_optional_mesh("loss")  # every data-parallel rank
    register_balancing_hook(optimizers, model_parts, loss_mesh.get_group() if loss_mesh is not None else None)
    return optimizers


def build_loss(job_config, **kwargs):
    """torchtitan's cross-entropy for logits (validation, checks, the baseline's way), and the
    summed loss our model's output layer computed itself, given the labels, passed on as is."""
    cross_entropy = build_cross_entropy_loss(job_config, **kwargs)

    def loss_of_output(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return pred if pred.dim() == 0 else cross_entropy(pred, labels)

    return loss_of_output


def _build_dataloader(dp_world_size, dp_rank, tokenizer, job_config):
    vocab_size = FLAVORS[job_config.model.flavor].vocab_size
    return build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, vocab_size)


def train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Qwen3MoEModel,
        model_args=_Flavors(),
        parallelize_fn=parallelize_qwen3_moe,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=_build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_loss,
        build_metrics_processor_fn=build_metrics_processor,
        # Hugging Face checkpoints in and out: [checkpoint] initial_load_in_hf / last_save_in_hf.
        state_dict_adapter=Qwen3MoEStateDictAdapter,
    )


def register() -> None:
    """Register "qwen3_moe" with torchtitan (once per process)."""
    try:
        get_train_spec(NAME)
    except ValueError:
        register_train_spec(NAME, train_spec())
