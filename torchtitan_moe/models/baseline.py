"""torchtitan 0.2.2's own Qwen3-MoE, registered as "torchtitan_qwen3_moe", for side-by-side runs.

Its model, parallelize function (EP, FSDP2, activation checkpointing, compile) and
optimizers exactly as torchtitan ships them, with the shapes of our flavors and our data
and tokenizer, so `bench_train` and the parity harness compare both stacks on the same
tokens. Our [moe], [router], [dispatch], [kernels] and [checks] sections do not apply to
it; its balancing is torchtitan's (the expert bias is kept but, in 0.2.2's Qwen3 spec, never
updated), and `--debug.moe_force_load_balance` is its forced-balance switch.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchtitan_moe.data import build_dataloader, build_tokenizer
from torchtitan_moe.metrics import build_metrics_processor
from torchtitan_moe.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs
from torchtitan_moe.torchtitan_compat import (
    TorchtitanMoEArgs,
    TorchtitanQwen3Model,
    TorchtitanQwen3ModelArgs,
    TrainSpec,
    build_cross_entropy_loss,
    build_lr_schedulers,
    build_optimizers,
    get_train_spec,
    register_train_spec,
    torchtitan_parallelize_qwen3,
    use_sum_reductions,
)

NAME = "torchtitan_qwen3_moe"


def torchtitan_args(ours: Qwen3MoEArgs) -> TorchtitanQwen3ModelArgs:
    """The torchtitan Qwen3 args with the same shapes as one of our flavors."""
    moe = ours.moe
    return TorchtitanQwen3ModelArgs(
        dim=ours.dim, n_layers=ours.n_layers, n_heads=ours.n_heads, n_kv_heads=ours.n_kv_heads,
        head_dim=ours.head_dim, vocab_size=ours.vocab_size, norm_eps=ours.norm_eps, rope_theta=ours.rope_theta,
        qk_norm=ours.qk_norm, max_seq_len=ours.max_seq_len, enable_weight_tying=ours.enable_weight_tying,
        moe_enabled=True, moe_inter_dim=moe.inter_dim,
        moe_args=TorchtitanMoEArgs(
            num_experts=moe.num_experts, num_shared_experts=0, top_k=moe.top_k, score_func=moe.score_func,
            route_norm=moe.route_norm, route_scale=moe.route_scale, score_before_experts=False,
        ),
    )


class _Flavors(Mapping):
    """Fresh args per lookup: torchtitan's Trainer edits the args it is given."""

    def __getitem__(self, name: str) -> TorchtitanQwen3ModelArgs:
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
            model_cls=TorchtitanQwen3Model,
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
