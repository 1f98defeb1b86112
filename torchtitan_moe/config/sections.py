"""Our TOML sections and the semantic checks that stop a bad config before training (impossible
combinations of valid values; unknown keys and wrong types are config/structure.py's).

torchtitan merges `JobConfig` below into its own (``job.custom_config_module =
"torchtitan_moe.config.sections"``, which our entry points add by themselves), so these sections
live in the same TOML file and take the same ``--section.key value`` overrides.

[moe] and [router] are the MoE layer's settings as moe/options.py declares them, redeclared here only
where a run's default differs from a bare layer's; `moe_args` turns them into the layers' args.

Every problem is reported as one `ConfigError` line that names the key and what is allowed.
This module imports nothing from torchtitan: the merged config class is passed in. No
`from __future__ import annotations` here: torchtitan and the checks read real field types.
"""


import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from torchtitan_moe.dispatch import registry
from torchtitan_moe.moe.options import MoEArgs, MoEOptions, RouterOptions, moe_problem
from torchtitan_moe.moe.router_losses import BalanceLoss

MODEL_NAMES = ("qwen3_moe", "torchtitan_qwen3_moe")


class ConfigError(ValueError):
    """A config problem, worded as one line naming the key and what is allowed."""


# Keys that were replaced, with what replaces them: a config that still names one stops here.
REPLACED_KEYS = {
    ("router", "aux_loss_coeff"): 'replaced by balance_loss = "sequence" (its loss) and balance_loss_coeff (its weight)',
}


# [moe] and [router]: moe/options.py's, with a run's defaults. No class docstrings: --help would print them.


@dataclass
class Moe(MoEOptions):  # the shape defaults to the model flavor's
    num_experts: int | None = None
    """Routed experts per MoE layer (default: the model flavor's)."""

    top_k: int | None = None
    """Experts each token is sent to (default: the model flavor's)."""

    inter_dim: int | None = None
    """Hidden size of each expert (default: the model flavor's)."""


@dataclass
class Router(RouterOptions):  # the flavor's scores unless set, and Qwen3's balancing recipe
    score_func: Literal["softmax", "sigmoid"] | None = None
    """Score function over the gate logits (default: the model flavor's)."""

    route_norm: bool | None = None
    """Renormalize the top-k probabilities to sum to 1 (default: the model flavor's)."""

    bias_update_rate: float = 0.0
    """Aux-loss-free balancing: step of the expert-bias update per optimizer step (0: off, the default:
    Hugging Face's Qwen3-MoE has no expert bias, so a model trained with one does not export as trained)."""

    balance_loss: BalanceLoss = "global_batch"

    balance_loss_coeff: float = 1e-3
    """Each MoE layer adds coeff x its balance loss (Megatron-LM, DeepSeek-V3); > 0 exactly when
    balance_loss is not 'none'. HF's Qwen3 adds its coefficient once, at top_k x our scale. The
    defaults (global_batch, 1e-3, no expert bias) are Qwen3's recipe, as the shipped configs train."""


@dataclass
class Dispatch:
    backend: Literal[("auto", *registry.NAMES)] = "auto"
    """How tokens reach their experts: a dispatcher of torchtitan_moe/dispatch/registry.py, where each says
    what it takes: 'local' (EP = 1), 'all_to_all' (torch.distributed, one copy of a token per destination
    rank), 'deepep' (DeepEP's NVLink kernels, EP = 2, 4, 8 on one node), 'all_gather' (EP = 2 on one node:
    every token to both ranks on the GPUs' copy engines, no SM held); or 'auto' (local at EP = 1; else the
    fastest in tuned_file that this run can use, else all_to_all)."""

    tuned_file: str = ""
    """Your own dispatcher timings and DeepEP settings (`python -m torchtitan_moe.tools.tune_dispatch`
    writes them), looked up before the table shipped with the package (measured on H200s);
    unset: the shipped table alone."""

    num_sms: int = 0
    """DeepEP's SMs (even); 0: the tuned file's, else DeepEP's default (24)."""

    buffers: Literal["exact", "worst_case"] = "exact"
    """EP > 1: 'exact' sizes the received rows from their counts (one host sync per MoE layer);
    'worst_case' for the most a rank can receive: no host sync, more memory (dispatch/all_to_all.py)."""

    recompute: Literal["replay", "exchange"] = "replay"
    """EP > 1 under activation checkpointing, what the recomputed forward does for its exchanges: 'replay'
    what the first forward kept (no network time; memory: every checkpointed layer's received rows until
    its backward, 0.23 GiB a layer at Qwen3-30B-A3B, EP 4, local batch 2), or 'exchange' the rows again
    (network time; the split sizes or DeepEP's handle kept: no host sync). dispatch/replay.py."""

    overlap: Literal["none", "chunks"] = "none"
    """EP > 1: 'chunks' splits each MoE layer's tokens in two, one chunk's dispatch or combine in
    flight while the other's experts compute (moe/chunks.py); opt-in: slower at 30B-A3B shapes on 2 H200s."""


@dataclass
class Kernels:
    backend: Literal["auto", "torch", "triton"] = "auto"
    """MoE hot-path ops: 'torch' reference, 'triton' kernels, 'auto' (triton on CUDA, torch on CPU)."""


@dataclass
class Checks:
    router_init: Literal["error", "warn", "off"] = "error"
    """Router-init checks before step 1: stop ('error'), log ('warn') or skip ('off')."""

    monitor_freq: int = 10
    """Run the training-health monitors every N steps (0: off)."""

    hang_timeout: float = -1.0
    """Seconds a step (or a save) may take before the run is taken as hung: every rank's stack is written to
    <dump_folder>/hang/ and the run stops in one line naming where each rank waits (train/watchdog.py).
    -1: 90% of the collectives' own timeout ([comm] init_timeout_seconds until step 1, then
    train_timeout_seconds), so the stacks come before the collective's error; 0: off."""

    init_fingerprint: bool = False
    """Write <dump_folder>/init_fingerprint.json before step 1: per weight, in torchtitan's Qwen3
    names, its sum and sum of squares in float64 (the parity harness checks runs start alike)."""


@dataclass
class Data:
    tokenizer: str = "bytes"
    """'bytes' (byte-level, no file) or a path to a tokenizers `tokenizer.json` (text data)."""

    synthetic_seed: int = 1234
    """Seed of the synthetic stream's hidden Markov chain (the same on every rank)."""

    synthetic_successors: int = 4
    """Likely next tokens per token in the synthetic stream (lower: easier to learn)."""

    sources: list[dict[str, Any]] = field(default_factory=list)
    """dataset = 'shards': the sources, each a folder of token shards with its share of the samples,
    e.g. [{path = "shards/web", weight = 0.7}, {path = "shards/code", weight = 0.3}] (weight: default 1).
    Empty: the one source [training] dataset_path. Make shards with
    `python -m torchtitan_moe.components.data.prepare` (docs/data.md)."""

    shuffle_seed: int = 0
    """dataset = 'shards': the seed of the samples' order (which source, which window, each epoch)."""

    attention: Literal["causal", "document"] = "causal"
    """'causal' over the whole sample, or 'document' (dataset = 'shards'): tokens attend only within their
    own document and its RoPE positions restart at 0 (flex-attention on a GPU; a dense mask on the CPU)."""

    workers: int = 1
    """Processes that make the batches beside training (the DataLoader's num_workers). 0 makes them in the
    training process, between steps: the synthetic walk is a Python loop of about 3 ms a sequence of 4,096
    tokens on the lent hosts, which a step whose host is the bottleneck (local batch 2) waits for."""


@dataclass
class Model:
    hf_assets_path: str = "."
    """A Hugging Face model folder: [checkpoint] initial_load_in_hf without initial_load_path loads its
    weights, and its model.safetensors.index.json (if any) shards a last_save_in_hf export the same
    way. The tokenizer comes from [data], not from here."""

    init_from: Literal["own", "qwen3_moe"] = "own"
    """The weights the torchtitan_qwen3_moe baseline starts from: its own init, or the one our
    qwen3_moe model makes from the same seed (parity against torchtitan). Ours: 'own' only."""


@dataclass
class Checkpoint:
    last_save_model_only: bool = False
    """Save the last step as the model only (weights to export or evaluate) instead of a full
    checkpoint. torchtitan's default is true; ours is false, so that a finished run can be
    extended with more steps (optimizer, step and data position included)."""


@dataclass
class ActivationCheckpoint:
    offload_inputs: bool = False
    """With mode = 'full': each block's input (all a checkpointed block keeps for its backward) copied to pinned
    host memory while the block computes and brought back one block ahead of its backward, on a side stream
    (parallel/offload.py; the same bits). Frees the block inputs' GPU memory (the full model at local batch 16:
    12 GiB a GPU) for a larger batch; costs host memory of the same size on every GPU and PCIe traffic both ways.
    Our model only."""
    offload_attention: bool = False
    """With offload_inputs: each offloaded block's attention output and log-sum-exp follow its input to host
    memory and back, and the block's recompute takes them instead of running the attention's forward again
    (ops/attention.py, cuDNN's kernels on a GPU; the recompute reads the bits the forward made). Saves the
    recompute's attention forward, 5% of the full Qwen3-30B-A3B's step FLOPs at seq 4096; costs twice the block
    inputs' host memory and PCIe traffic again (the attention's output is twice the model's width there).
    Causal attention only ([data] attention)."""


@dataclass
class Optimizer:
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's exp_avg and exp_avg_sq stored in 'float32' (torch's AdamW) or 'bfloat16' (4 bytes less
    per parameter; fp32 update and master weights; components/optimizer.py)."""
    update: Literal["auto", "torch", "triton"] = "auto"
    """Where AdamW's update runs: 'torch' (torchtitan's optimizer, fp32 moments), 'triton' (ours: one
    pass per parameter that also writes the experts' bf16 working copies; fp32 or bf16 moments), or
    'auto': 'triton' for bf16 moments and for AdamW on a GPU, else 'torch'."""
    expert_grad_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The experts' weight gradients where the experts keep bf16 working copies (outside FSDP2): an fp32
    copy for each fp32 master weight ('float32'), or 'bfloat16': the GEMMs' own gradients, left on the
    working copies (the same values; 2 bytes a weight instead of 4 and no pass that widens them). That needs
    one micro-batch a step, our AdamW and no pipeline parallelism (optimizer.keep_expert_gradients);
    'bfloat16' refuses a run without them, 'auto' takes it where they hold and 'float32' elsewhere. Our
    model's experts only: the torchtitan baseline (no working copies) ignores it."""


@dataclass
class Parallelism:
    embedding: Literal["auto", "fsdp", "rows"] = "auto"
    """How the token embedding is sharded over the FSDP ranks: 'fsdp' (FSDP2 gathers the weight for the
    forward and reduce-scatters its gradient, both exposed at the step's ends), 'rows' (each rank keeps
    its rows and the tokens and their gradients travel instead: parallel/embedding.py), or 'auto': 'rows'
    under FSDP without HSDP replicas or tied weights, else 'fsdp'. Our model only."""
    router: Literal["auto", "fsdp", "rows"] = "auto"
    """How each router's fp32 gate is sharded over the FSDP ranks: 'fsdp' (an FSDP2 group of its own per
    layer), 'rows' (each rank keeps its rows and the router gathers them in its forward, reduce-scattering
    the gradient in its backward, without FSDP2's hooks: parallel/router_gate.py; the same values), or
    'auto': 'rows' under FSDP without HSDP replicas where the experts split evenly over the ranks, else
    'fsdp'. Our model only."""


@dataclass
class Metrics:
    peak_tflops: float = 0.0
    """Peak TFLOP/s that MFU is measured against (0: torchtitan's dense bf16 figure for the GPU)."""


@dataclass
class Training:
    dataset: str = "synthetic"
    """'synthetic' (learnable Markov stream, no files), 'text' (local files at dataset_path, tokenized as
    read) or 'shards' (pretokenized shards: [data] sources, or the folder at dataset_path)."""

    on_nonfinite: Literal["stop", "skip_step", "warn"] = "stop"
    """A step whose loss or gradient norm is NaN or inf: 'stop' the run (one line naming the step and the
    last good checkpoint, exit status 3, nothing saved from it on), 'skip_step' (its update skipped, with a
    warning; a host sync per step) or 'warn' (train on). A save from NaN weights is refused whatever this says."""

    max_skipped_steps: int = 10
    """on_nonfinite = 'skip_step': the run stops as 'stop' does once this many steps in a row were skipped
    (a run whose every step is NaN trains nothing, whatever the cause: skipping on would hide it)."""

    expandable_segments: bool = True
    """CUDA's caching allocator grows one segment per stream in place (PYTORCH_CUDA_ALLOC_CONF's
    expandable_segments, which torchtitan's own launcher sets) instead of keeping fixed-size segments that
    blocks of other sizes cannot reuse: the full model on 4 GPUs at local batch 12 reserved 113 GiB with
    it, 119 without. This key sets it for the run; an environment that says otherwise is refused."""


@dataclass
class JobConfig:
    """Merged by torchtitan's ConfigManager into its own JobConfig."""

    moe: Moe = field(default_factory=Moe)
    router: Router = field(default_factory=Router)
    dispatch: Dispatch = field(default_factory=Dispatch)
    kernels: Kernels = field(default_factory=Kernels)
    checks: Checks = field(default_factory=Checks)
    data: Data = field(default_factory=Data)
    model: Model = field(default_factory=Model)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    training: Training = field(default_factory=Training)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)


def moe_args(cfg: Any, flavor: MoEArgs) -> MoEArgs:
    """The MoE layers' args in a run: the model flavor's, with every [moe] and [router] key the config sets
    (a key left unset, None, keeps the flavor's), [kernels] backend and [training] mixed_precision_param."""
    router = replace(flavor.router, **_set_keys(cfg.router))
    return replace(flavor, **_set_keys(cfg.moe), kernels=cfg.kernels.backend,
                   param_dtype=cfg.training.mixed_precision_param, router=router)


def _set_keys(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(section) if getattr(section, f.name) is not None}


# ---------------------------------------------------------------------------------------
# Semantics: impossible combinations, checked on the parsed config (TOML + CLI overrides).
# ---------------------------------------------------------------------------------------


def allocator_problem(expandable: bool, alloc_conf: str) -> str | None:
    """[training] expandable_segments against PYTORCH_CUDA_ALLOC_CONF's own setting of it, if any."""
    for option in alloc_conf.replace(";", ",").split(","):
        name, _, value = option.partition(":")
        if name.strip() == "expandable_segments" and (value.strip().lower() == "true") != expandable:
            return (f"[training] expandable_segments = {str(expandable).lower()} but PYTORCH_CUDA_ALLOC_CONF "
                    f"says {option.strip()!r}: set one of them, or both the same")
    return None


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _refuse(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


def check_semantics(cfg: Any, flavors: dict[str, Any], world_size: int | None = None) -> None:
    """Check combinations that cannot train. `flavors` maps flavor names to model args (their `.moe`,
    MoEArgs, is what [moe] and [router] update: the MoE layers' args are checked as the layers check them)."""
    _refuse(allocator_problem(cfg.training.expandable_segments, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")))
    ac = cfg.activation_checkpoint
    _need(not ac.offload_inputs or ac.mode == "full",
          f"[activation_checkpoint] offload_inputs = true offloads what full recompute keeps, each block's input: it "
          f"needs mode = 'full' (got {ac.mode!r})")
    _need(not ac.offload_attention or ac.offload_inputs,
          "[activation_checkpoint] offload_attention = true sends the attention's outputs to host memory with each "
          "block's input: it needs offload_inputs = true")
    _need(not ac.offload_attention or cfg.data.attention == "causal",
          f"[activation_checkpoint] offload_attention = true keeps causal attention's outputs: it needs [data] "
          f"attention = 'causal' (got {cfg.data.attention!r})")
    _need(
        cfg.model.name in MODEL_NAMES,
        f"[model] name = {cfg.model.name!r}: expected 'qwen3_moe' (ours) or 'torchtitan_qwen3_moe' "
        "(torchtitan's own, the benchmark baseline)",
    )
    _need(
        cfg.model.flavor in flavors,
        f"[model] flavor = {cfg.model.flavor!r}: expected one of {', '.join(repr(f) for f in flavors)}",
    )
    _need(cfg.model.init_from == "own" or cfg.model.name == "torchtitan_qwen3_moe",
          f"[model] init_from = {cfg.model.init_from!r} is for the torchtitan_qwen3_moe baseline; "
          f"{cfg.model.name!r} starts from its own init ('own')")
    _need(cfg.model.init_from == "own" or cfg.debug.seed is not None,
          "[model] init_from = 'qwen3_moe' needs [debug] seed: our init draws from it (unset, every run differs)")
    layer = moe_args(cfg, flavors[cfg.model.flavor].moe)
    num_experts, top_k, router, par = layer.num_experts, layer.top_k, cfg.router, cfg.parallelism
    _refuse(moe_problem(layer, config_key))
    _need(cfg.metrics.peak_tflops >= 0, f"[metrics] peak_tflops = {cfg.metrics.peak_tflops}: must be >= 0 (0: from the GPU)")
    _need(cfg.checks.monitor_freq >= 0, f"[checks] monitor_freq = {cfg.checks.monitor_freq}: must be >= 0 (0: off)")
    hang = cfg.checks.hang_timeout
    _need(hang == -1 or hang >= 0, f"[checks] hang_timeout = {hang}: must be seconds > 0, 0 (off) or -1 (from [comm]'s timeouts)")

    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        degree = getattr(par, key)
        _need(degree == 1, f"[parallelism] {key} = {degree}: qwen3_moe supports FSDP and EP only; set 1")
    ep = par.expert_parallel_degree
    _need(ep >= 1, f"[parallelism] expert_parallel_degree = {ep}: must be >= 1")
    _need(
        num_experts % ep == 0,
        f"[parallelism] expert_parallel_degree = {ep}: must divide [moe] num_experts ({num_experts})",
    )
    _need(
        par.expert_tensor_parallel_degree == 1,
        f"[parallelism] expert_tensor_parallel_degree = {par.expert_tensor_parallel_degree}: only 1 is supported",
    )
    shard = par.data_parallel_shard_degree
    if shard != -1:
        _need(shard >= 1, f"[parallelism] data_parallel_shard_degree = {shard}: must be -1 (all) or >= 1")
        _need(shard % ep == 0, f"[parallelism] expert_parallel_degree = {ep}: must divide data_parallel_shard_degree ({shard})")
    replicate = par.data_parallel_replicate_degree
    _need(replicate >= 1, f"[parallelism] data_parallel_replicate_degree = {replicate}: must be >= 1")
    if world_size is not None:
        check_data_parallel(replicate, shard, ep, world_size)
    _need(par.embedding != "rows" or replicate == 1, f"[parallelism] embedding = 'rows' shards the embedding over "
          f"the FSDP ranks of one replica: with data_parallel_replicate_degree = {replicate} use 'fsdp' or 'auto'")
    _need(par.router != "rows" or replicate == 1, f"[parallelism] router = 'rows' shards each router's gate over "
          f"the FSDP ranks of one replica: with data_parallel_replicate_degree = {replicate} use 'fsdp' or 'auto'")

    if cfg.model.name == "qwen3_moe":  # [dispatch] configures our MoE layers; torchtitan's has its own EP
        check_dispatch(cfg, ep)

    train = cfg.training
    _need(train.dataset in ("synthetic", "text", "shards"),
          f"[training] dataset = {train.dataset!r}: expected 'synthetic' or 'text', or 'shards' (token shards)")
    if train.dataset == "text" or (train.dataset == "shards" and not cfg.data.sources):
        path = train.dataset_path
        _need(bool(path) and os.path.exists(path),
              f"[training] dataset_path = {path!r}: no such file or folder (needed by dataset = {train.dataset!r})")
    elif train.dataset == "synthetic":
        _need(not train.dataset_path, f"[training] dataset_path = {train.dataset_path!r} is not read: dataset = "
              "'synthetic' makes its own tokens; set dataset = 'text' to train on the files, or unset dataset_path")
    check_data_sources(cfg.data, train.dataset)
    _need(train.max_skipped_steps >= 1, f"[training] max_skipped_steps = {train.max_skipped_steps}: must be >= 1 (the "
          "steps skipped in a row, with on_nonfinite = 'skip_step', after which the run stops)")
    tokenizer = cfg.data.tokenizer
    _need(
        tokenizer == "bytes" or os.path.isfile(tokenizer),
        f"[data] tokenizer = {tokenizer!r}: expected 'bytes' or the path of a tokenizer.json",
    )
    _need(train.seq_len >= 2, f"[training] seq_len = {train.seq_len}: must be >= 2")
    _need(train.local_batch_size >= 1, f"[training] local_batch_size = {train.local_batch_size}: must be >= 1")
    _need(cfg.data.synthetic_successors >= 1, f"[data] synthetic_successors = {cfg.data.synthetic_successors}: must be >= 1")
    _need(cfg.data.workers >= 0, f"[data] workers = {cfg.data.workers}: must be >= 0 (0: batches made in the training process)")

    ck = cfg.checkpoint
    _need(
        not ck.initial_load_in_hf or ck.initial_load_model_only,
        "[checkpoint] initial_load_in_hf = true loads weights only: leave initial_load_model_only = true",
    )
    if ck.last_save_in_hf:
        _need(
            ck.last_save_model_only,
            "[checkpoint] last_save_in_hf = true saves the last step as weights only: also set last_save_model_only "
            "= true (that step then cannot be resumed; `python -m torchtitan_moe.hf.convert to-hf` exports any full step)",
        )
        _need(
            router.bias_update_rate == 0,
            f"[checkpoint] last_save_in_hf = true with [router] bias_update_rate = {router.bias_update_rate}: Hugging "
            "Face Qwen3-MoE has no expert bias, so the export would route unlike the trained model; set "
            "bias_update_rate = 0 (the shipped configs balance with balance_loss = 'global_batch'), or export later with "
            "`python -m torchtitan_moe.hf.convert to-hf STEP OUT --drop-expert-bias --config RUN.toml`, which prints what "
            "dropping the bias costs",
        )
        _need(
            router.score_func in (None, "softmax") and router.route_scale == 1.0,
            "[checkpoint] last_save_in_hf = true: Hugging Face Qwen3-MoE routes with score_func = 'softmax' and "
            "route_scale = 1.0 only",
        )
        _need(
            router.topk_groups >= router.n_groups,
            f"[checkpoint] last_save_in_hf = true with [router] n_groups = {router.n_groups}, topk_groups = "
            f"{router.topk_groups}: Hugging Face Qwen3-MoE picks its top-k over all experts (no group-limited "
            "routing); set n_groups = 1",
        )


def check_data_parallel(replicate: int, shard: int, ep: int, world_size: int) -> None:
    """HSDP (replicate x shard) and EP against the number of processes.

    torchtitan 0.2.2's meshes are world = dp_replicate x fsdp (dense) = dp_replicate x efsdp x ep
    (experts): EP splits one replica's FSDP group, never the replicas, so EP must divide it.
    """
    if shard == -1:
        _need(world_size % replicate == 0,
              f"[parallelism] data_parallel_replicate_degree = {replicate}: must divide the number of processes "
              f"({world_size}); each replica shards over the processes / replicate that data_parallel_shard_degree "
              "= -1 gives it")
    shard_size = world_size // replicate if shard == -1 else shard
    _need(
        replicate * shard_size == world_size,
        f"[parallelism] data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree "
        f"({shard}) must equal the number of processes ({world_size})",
    )
    if replicate > 1:
        _need(
            shard_size % ep == 0,
            f"[parallelism] expert_parallel_degree = {ep} with data_parallel_replicate_degree = {replicate}: EP splits "
            f"one replica's FSDP group ({shard_size} of {world_size} processes; torchtitan's mesh is dp_replicate x "
            f"efsdp x ep), so it must divide {shard_size}; use a smaller EP, or data_parallel_replicate_degree = 1 "
            f"for EP up to {world_size}",
        )
    _need(
        shard_size % ep == 0,
        f"[parallelism] expert_parallel_degree = {ep}: must divide the FSDP group size ({shard_size} "
        f"of {world_size} processes)",
    )


def check_data_sources(data: Any, dataset: str) -> None:
    """[data] sources, shuffle_seed and attention (the shards themselves: components/data/packed.py)."""
    _need(not data.sources or dataset == "shards",
          f"[data] sources are read by [training] dataset = 'shards' (this run's is {dataset!r})")
    for i, source in enumerate(data.sources):
        _need(set(source) <= {"path", "weight"} and isinstance(source.get("path"), str),
              f"[data] sources[{i}] = {source!r}: expected {{path = \"FOLDER\", weight = W}} (weight: default 1)")
        weight = source.get("weight", 1.0)
        _need(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
              f"[data] sources[{i}] weight = {weight!r} (path {source['path']!r}): must be a number > 0")
        _need(os.path.exists(source["path"]), f"[data] sources[{i}] path = {source['path']!r}: no such file or folder")
    _need(data.attention == "causal" or dataset == "shards",
          f"[data] attention = {data.attention!r} needs documents: [training] dataset = 'shards' (this run's is "
          f"{dataset!r}; make shards with `python -m torchtitan_moe.components.data.prepare`)")


# The run's facts as a dispatcher's problem names them here (dispatch/registry.py: Run, Entry.problem).
DISPATCH_KEYS = {"ep": "[parallelism] expert_parallel_degree", "overlap": "[dispatch] overlap",
                 "buffers": "[dispatch] buffers", "param_dtype": "[training] mixed_precision_param"}


def dispatch_run(cfg: Any, ep: int, **facts: Any) -> registry.Run:
    """The config's run as the dispatchers' rules read it (`facts`: what only the caller knows, e.g.
    procs_per_node, gpus, shapes)."""
    return registry.Run(ep=ep, overlap=cfg.dispatch.overlap, buffers=cfg.dispatch.buffers,
                        param_dtype=cfg.training.mixed_precision_param, **facts)


def dispatch_instead(name: str, run: registry.Run) -> str:
    """"; use ..." with what to set instead of [dispatch] backend = name: the other dispatchers that take
    `run`, and 'auto' (which picks among them); "" where none does (the problem says what to change)."""
    others = [repr(e.name) for e in registry.usable(run) if e.name != name]
    if not others:
        return ""
    others.append("'auto'")
    return f"; use {', '.join(others[:-1])} or {others[-1]}"


def dispatch_refusal(name: str, run: registry.Run) -> str | None:
    """[dispatch] backend = name against `run`, in one line naming the keys; None where it takes the run."""
    problem = registry.get(name).problem(run, DISPATCH_KEYS)
    if problem is None:
        return None
    return f"[dispatch] backend = {name!r} {problem}{dispatch_instead(name, run)}"


def dispatch_unavailable(name: str, run: registry.Run, why: Any) -> str:
    """[dispatch] backend = name cannot run on this machine (`why`: the dispatcher's one line)."""
    return f"[dispatch] backend = {name!r}: {why}{dispatch_instead(name, run)}"


def check_dispatch(cfg: Any, ep: int) -> None:
    """[dispatch] against the EP degree and the precision (each dispatcher's rules: dispatch/registry.py)."""
    backend = cfg.dispatch.backend
    if backend != "auto":
        refusal = dispatch_refusal(backend, dispatch_run(cfg, ep))
        _need(refusal is None, refusal)
    _need(cfg.dispatch.overlap == "none" or ep > 1,
          f"[dispatch] overlap = {cfg.dispatch.overlap!r} overlaps the exchanges between EP ranks: it needs "
          f"[parallelism] expert_parallel_degree > 1 (got {ep}); use 'none'")
    recompute = cfg.dispatch.recompute
    _need(recompute == "replay" or (ep > 1 and cfg.activation_checkpoint.mode != "none"),
          f"[dispatch] recompute = {recompute!r} is what an activation-checkpointing recompute does for the exchanges "
          f"between EP ranks: it needs [parallelism] expert_parallel_degree > 1 (got {ep}) and [activation_checkpoint] "
          f"mode 'full' or 'selective' (got {cfg.activation_checkpoint.mode!r}); use 'replay'")
    num_sms = cfg.dispatch.num_sms
    _need(num_sms == 0 or (num_sms >= 2 and num_sms % 2 == 0),
          f"[dispatch] num_sms = {num_sms}: must be 0 (the tuned file's, else DeepEP's default) or an even number >= 2")
    tuned = [e.name for e in registry.DISPATCHERS.values() if e.tuned] + ["auto"]
    _need(num_sms == 0 or backend in tuned,
          f"[dispatch] num_sms = {num_sms} sets DeepEP's SMs: it needs backend = {' or '.join(map(repr, tuned))}")


def config_key(key: str) -> str:
    """A key of the MoE layer's settings (moe/options.py) in the config's words: '[router] n_groups', '[moe] top_k'."""
    return f"[router] {key}" if key in {f.name for f in fields(RouterOptions)} else f"[moe] {key}"
