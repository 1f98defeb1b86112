"""Parallelize Qwen3-MoE: expert parallelism, activation checkpointing, compile, FSDP2.

FSDP2 groups (outermost last):
    tok_embeddings (unless sharded by rows: embedding_by_rows) | per block: router (fp32 params;
    unless sharded by rows: router_by_rows), experts (EP: on the efsdp mesh), block | norm + output | model
Where the efsdp group has one rank (EP = the processes of a replica), the experts stay
outside FSDP2: see keep_experts_unsharded.
The router gets its own group with fp32 parameters so the gate is computed in fp32 even
when the rest of the block all-gathers bf16; or, sharded by rows, it gathers its fp32 gate itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.models.qwen3_moe.attention import KeptAttention
from torchtitan_moe.moe.experts import refresh_working_copies
from torchtitan_moe.ops.attention import register_keeper
from torchtitan_moe.parallel.build import build_dispatchers
from torchtitan_moe.parallel.embedding import shard_embedding_rows
from torchtitan_moe.parallel.offload import offload_block_inputs
from torchtitan_moe.parallel.router_gate import gate_rows_problem, shard_gate_rows
from torchtitan_moe.compat.torchtitan import ParallelDims, apply_ac, data_parallel_mesh, logger, use_sum_reductions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Ops whose outputs selective activation checkpointing keeps rather than recomputes.
_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten.max.default,
}


def parallelize_qwen3_moe(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    build_dispatchers(model, parallel_dims, job_config)

    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=job_config.compile.enable,
            op_sac_save_list=_SAC_SAVE_LIST,
            base_folder=job_config.job.dump_folder,
        )
        keep_exchanges_for_recompute(model, job_config.dispatch.recompute)
        if job_config.activation_checkpoint.offload_inputs:
            blocks = list(model.layers.values())
            offload = offload_block_inputs(blocks)
            logger.info(f"Block inputs offloaded to host memory between forward and backward: {len(blocks) - 1} of "
                        f"{len(blocks)} blocks ([activation_checkpoint] offload_inputs)")
            if job_config.activation_checkpoint.offload_attention:
                keep_attention_outputs(blocks, offload)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model, job_config.compile.backend)

    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        apply_fsdp(model, parallel_dims, job_config)
    else:
        for key in ("embedding", "router"):
            if getattr(job_config.parallelism, key) == "rows":
                raise ConfigError(f"[parallelism] {key} = 'rows' shards by rows over FSDP's ranks, but this run has "
                                  "one data-parallel rank: use 'fsdp' or 'auto'")
    return model


def keep_attention_outputs(blocks: list[nn.Module], offload) -> None:
    """[activation_checkpoint] offload_attention: every block's attention through ops.causal_attention with the
    offload as its keeper (the last block's recompute, not offloaded, computes its attention again)."""
    keeper = register_keeper(offload)
    for block in blocks:
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        inner.attention.inner_attention = KeptAttention(keeper)
    logger.info(f"Attention outputs kept in host memory for the recompute: {len(blocks) - 1} of {len(blocks)} blocks "
                "([activation_checkpoint] offload_attention)")


def apply_compile(model: nn.Module, backend: str) -> None:
    """torch.compile each block's dense math: `attend` (norms, attention, residual) and the router.

    Regions end where FSDP2's hooks are (dynamo does not trace them: a graph break there, and
    under activation checkpointing one break sends the whole block back to eager). So the
    router's forward is compiled inside its own FSDP hooks, not the block around them. The
    experts and dispatchers are not: their work is our custom ops (one opaque node each)
    and the exchange with its host sync, and their statistics and replays are Python state. Nor is
    the global-batch balance loss's running count (Router.forward around Router.route): a recompute
    must not count again, which compiled code cannot tell.
    """
    for block in model.layers.values():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        inner.attend = torch.compile(inner.attend, backend=backend, fullgraph=True)
        compile_router(inner.moe.router, backend)
    logger.info("Compiled each block's attention and router with torch.compile")


def compile_router(router: nn.Module, backend: str) -> None:
    """Compile the router's `route`: its forward stays eager to add the global-batch counts once per real forward."""
    router.route = torch.compile(router.route, backend=backend, fullgraph=True)


def keep_exchanges_for_recompute(model: nn.Module, recompute: str) -> None:
    """In checkpointed blocks, the dispatchers keep what the recompute needs ([dispatch] recompute):
    the exchanges' results to replay ('replay': no network time, a buffer a layer), or only what
    spares a second exchange its host sync ('exchange'). dispatch/replay.py."""
    kept = []
    for block in model.layers.values():
        dispatcher = block.moe.dispatcher
        if isinstance(block, CheckpointWrapper) and hasattr(dispatcher, "keep_exchanges"):
            dispatcher.keep_exchanges = True
            dispatcher.recompute = recompute
            kept.append(dispatcher)
    for how in sorted({d.recompute for d in kept}):  # read back from the dispatchers: what they will do
        what = {"replay": "replays the exchanges its forward kept", "exchange": "exchanges again"}[how]
        layers = sum(d.recompute == how for d in kept)
        logger.info(f"Activation checkpointing: the recompute of {layers} MoE layers {what} ([dispatch] recompute = "
                    f"{how!r})")


def apply_fsdp(model: nn.Module, parallel_dims: ParallelDims, job_config) -> None:
    training = job_config.training
    mp = MixedPrecisionPolicy(
        param_dtype=_DTYPES[training.mixed_precision_param],
        reduce_dtype=_DTYPES[training.mixed_precision_reduce],
    )
    # The router's inputs stay in the blocks' dtype: with bf16 tokens its fp32 gate runs on the bf16 tensor
    # cores (ops.gate_logits), its fp32 math otherwise casting them itself.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    dp_mesh = data_parallel_mesh(parallel_dims)  # (dp_replicate,) fsdp: HSDP, FSDP, or replication only
    ep = parallel_dims.ep
    reshard = {"default": True, "always": True, "never": False}[job_config.parallelism.fsdp_reshard_after_forward]

    unsharded_experts: set[nn.Parameter] = set()  # their FSDP group would have one rank
    outside_fsdp: set[nn.Parameter] = set()  # the above, and the embedding and gates sharded by rows
    if embedding_by_rows(job_config.parallelism.embedding, model, dp_mesh):
        shard_embedding_rows(model.tok_embeddings, dp_mesh, mp.param_dtype)
        outside_fsdp.add(model.tok_embeddings.weight)
    else:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    gate_rows = router_by_rows(job_config.parallelism.router, model, dp_mesh)
    edp_mesh = None  # the experts' data-parallel mesh under EP
    if ep > 1:
        edp_mesh = parallel_dims.get_mesh(["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"])
    for block in model.layers.values():
        moe = block.moe
        if gate_rows:
            shard_gate_rows(moe.router.gate, dp_mesh)
            outside_fsdp.add(moe.router.gate.weight)
        else:
            fully_shard(moe.router, mesh=dp_mesh, mp_policy=fp32, reshard_after_forward=reshard)
        if ep > 1:
            if experts_outside_fsdp(edp_mesh):
                keep_experts_unsharded(moe.experts, mp.param_dtype)
                unsharded_experts |= set(moe.experts.parameters())
            else:
                shard_experts(moe.experts, edp_mesh, ep, mp, reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard,
                    ignored_params=(unsharded_experts | outside_fsdp) & set(block.parameters()))
    fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, ignored_params=unsharded_experts | outside_fsdp)
    if unsharded_experts:  # their working copies current before the (compiled) blocks read them
        model.register_forward_pre_hook(refresh_working_copies)

    # The loss is already divided by the global token count: FSDP must only sum.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    use_sum_reductions(model)
    logger.info(f"Applied FSDP2 over {list(dp_mesh.mesh_dim_names)} {tuple(dp_mesh.shape)}, EP = {ep}"
                + (", experts outside FSDP2 (one rank per expert shard)" if unsharded_experts else "")
                + (", the embedding sharded by rows" if model.tok_embeddings.weight in outside_fsdp else "")
                + (", the routers' gates sharded by rows" if gate_rows else ""))


def embedding_by_rows(setting: str, model: nn.Module, dp_mesh) -> bool:
    """[parallelism] embedding: whether the embedding keeps its rows on their ranks (parallel/embedding.py)
    instead of FSDP2 gathering it: on a 1-D FSDP mesh of more than one rank, weights untied. 'rows' refuses
    anything else, 'auto' takes FSDP2 there."""
    tied = model.output.weight is model.tok_embeddings.weight
    why_not = ("HSDP replicates it (a 2-D mesh)" if dp_mesh.ndim != 1 else
               "its FSDP group has one rank" if dp_mesh.size() == 1 else
               "the output layer shares its weight (enable_weight_tying)" if tied else None)
    return by_rows("embedding", setting, why_not, "the embedding")


def router_by_rows(setting: str, model: nn.Module, dp_mesh) -> bool:
    """[parallelism] router: whether each router keeps its gate's rows on their ranks and gathers them itself
    (parallel/router_gate.py) instead of an FSDP2 group of its own: on a 1-D FSDP mesh of more than one rank
    whose size divides the experts. 'rows' refuses anything else, 'auto' takes FSDP2 there."""
    router = next(iter(model.layers.values())).moe.router
    why_not = gate_rows_problem(dp_mesh, router.num_experts)
    return by_rows("router", setting, why_not, "each router's gate")


def by_rows(key: str, setting: str, why_not: str | None, what: str) -> bool:
    """[parallelism] `key` = `setting` ('auto', 'fsdp' or 'rows'), where sharding `what` by rows is impossible
    for the reason `why_not` (None: possible): whether to shard it by rows; 'rows' where it cannot is an error."""
    if setting == "fsdp" or (setting == "auto" and why_not):
        return False
    if why_not:
        raise ConfigError(f"[parallelism] {key} = 'rows' shards {what} by rows over FSDP's ranks, but {why_not}: "
                          "use 'fsdp' or 'auto'")
    return True


def shard_experts(experts: nn.Module, edp_mesh, ep: int, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """FSDP2 over the experts' data-parallel group (efsdp, and dp_replicate under HSDP)."""
    # When experts are fewer than efsdp x ep shards, shard each expert's rows instead.
    placement = (lambda p: Shard(1)) if edp_mesh.size() > experts.num_experts // ep else None
    # The experts take an ExpertBatch whose probs must stay fp32: FSDP must not cast the
    # inputs (the experts cast their rows to the weights' dtype themselves).
    experts_mp = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                      cast_forward_inputs=False)
    fully_shard(experts, mesh=edp_mesh, mp_policy=experts_mp, reshard_after_forward=reshard,
                shard_placement_fn=placement)


def experts_outside_fsdp(edp_mesh) -> bool:
    """Whether the experts stay outside FSDP2: their data-parallel group has one rank."""
    return edp_mesh.size() == 1


def keep_experts_unsharded(experts: nn.Module, param_dtype: torch.dtype) -> None:
    """Experts whose FSDP group would have one rank (EP = the replica's processes) stay outside FSDP2.

    There FSDP2 shards nothing and reduces nothing, yet per step it would cast the fp32 weights
    into its all-gather buffer, "all-gather" and copy them out (again for backward when it
    reshards), and copy the bf16 gradients into an fp32 buffer to "reduce-scatter" them. Here
    the fp32 weights (the optimizer's master copy, EP-sharded DTensors) keep a working copy in
    `param_dtype` that the GEMMs read in forward and backward: cast once after each update, or
    written by the update itself where the optimizer can (ours, optimizer.attach_working_copies).
    Their gradients come back in fp32. The copy lives between steps (2 bytes per expert weight on
    this rank), whatever `fsdp_reshard_after_forward` says: it is what saves the casts.
    """
    experts.param_dtype = param_dtype
