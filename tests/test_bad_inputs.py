"""Every bad input a user can give is refused in exactly one line that names the key, file or argument and
what is allowed, with its exit status, no traceback, and nothing written or lost. The
same line whether a config value comes from the TOML file or a flag. In-process, about 0.1 s a case:

    the config check (tools/check_config, which scripts/train.sh runs before launch): values, types, keys,
        combinations, process counts, non-UTF-8 TOML, the text data (every file and record), the run folder's
        lock, the checkpoint the run would load (its metadata, files, checksums, shapes, data positions), a
        tuned dispatch file
    convert (to-hf, from-hf), scripts/build_tokenizer.py, the planner, the trainer's own exit lines and the
    launcher's (train/launch.py), and scripts/train.sh (a subprocess).

`test_every_refusal_in_the_source_has_a_case` reads the refusals out of the source (each `_need(...)` and
`raise ...Error(...)` message of the modules the check runs) and fails for one that no case here produces."""

import ast
import contextlib
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from torchtitan_moe.hf import convert
from torchtitan_moe.tools import check_config, plan

from test_config import debug_with

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")
PACKAGE = ROOT / "torchtitan_moe"

# (section, key, bad value, what the one line must say). Each runs twice: in the TOML and as a flag.
VALUES = [
    ("optimizer", "lr", -1.0, "[optimizer] lr = -1.0: must be a number >= 0"),
    ("optimizer", "lr", float("inf"), "[optimizer] lr = inf: must be a number >= 0"),
    ("optimizer", "beta1", 1.0, "[optimizer] beta1 = 1.0: must be in [0, 1)"),
    ("optimizer", "beta2", -0.5, "[optimizer] beta2 = -0.5: must be in [0, 1)"),
    ("optimizer", "eps", 0.0, "[optimizer] eps = 0.0: must be > 0"),
    ("optimizer", "weight_decay", -0.1, "[optimizer] weight_decay = -0.1: must be >= 0"),
    ("training", "steps", 0, "[training] steps = 0: must be >= 1"),
    ("training", "steps", -5, "[training] steps = -5: must be >= 1"),
    ("lr_scheduler", "warmup_steps", -1, "[lr_scheduler] warmup_steps = -1: must be >= 0"),
    ("lr_scheduler", "decay_ratio", 1.5, "[lr_scheduler] decay_ratio = 1.5: must be in [0, 1]"),
    ("lr_scheduler", "total_steps", 0, "[lr_scheduler] total_steps = 0: must be >= 1"),
    ("lr_scheduler", "min_lr_factor", 2.0, "[lr_scheduler] min_lr_factor = 2.0: must be in [0, 1]"),
    ("training", "max_norm", 0.0, "[training] max_norm = 0.0: must be > 0"),
    ("training", "max_norm", -1.0, "[training] max_norm = -1.0: must be > 0"),
    ("training", "local_batch_size", 0, "[training] local_batch_size = 0: must be >= 1"),
    ("training", "seq_len", 1, "[training] seq_len = 1: must be >= 2"),
    ("training", "global_batch_size", 0, "[training] global_batch_size = 0: must be -1"),
    ("training", "dataset", "c4", "[training] dataset = 'c4': expected 'synthetic' or 'text'"),
    ("metrics", "log_freq", 0, "[metrics] log_freq = 0: must be >= 1"),
    ("metrics", "peak_tflops", -1.0, "[metrics] peak_tflops = -1.0: must be >= 0"),
    ("data", "tokenizer", "missing.json", "[data] tokenizer = 'missing.json': expected 'bytes' or the path"),
    ("data", "tokenizer", DEBUG, "[data] tokenizer = '" + DEBUG + "': not a tokenizers tokenizer.json"),
    ("data", "synthetic_successors", 0, "[data] synthetic_successors = 0: must be >= 1"),
    ("model", "name", "llama3", "[model] name = 'llama3': expected 'qwen3_moe'"),
    ("model", "flavor", "huge", "[model] flavor = 'huge': expected one of"),
    ("moe", "num_experts", 0, "[moe] num_experts = 0: must be >= 1"),
    ("moe", "top_k", 9, "[moe] top_k = 9: must be in 1..num_experts (8)"),
    ("moe", "top_k", 0, "[moe] top_k = 0: must be in 1..num_experts"),
    ("moe", "inter_dim", 0, "[moe] inter_dim = 0: must be >= 1"),
    ("moe", "align", 7, "[moe] align = 7: must be one of 8, 16, 32"),
    ("router", "init_std", -0.1, "[router] init_std = -0.1: must be >= 0"),
    ("router", "route_scale", 0.0, "[router] route_scale = 0.0: must be > 0"),
    ("router", "bias_update_rate", -1.0, "[router] bias_update_rate = -1.0: must be >= 0"),
    ("router", "balance_loss_coeff", -1.0, "[router] balance_loss_coeff = -1.0: must be >= 0"),
    ("router", "z_loss_coeff", -1.0, "[router] z_loss_coeff = -1.0: must be >= 0"),
    ("router", "n_groups", 3, "[router] n_groups = 3: must divide [moe] num_experts (8)"),
    ("router", "n_groups", 0, "[router] n_groups = 0: must be >= 1"),
    ("router", "topk_groups", 2, "[router] topk_groups = 2: must be in 1..n_groups (1)"),
    ("checks", "monitor_freq", -1, "[checks] monitor_freq = -1: must be >= 0"),
    ("parallelism", "expert_parallel_degree", 3, "[parallelism] expert_parallel_degree = 3: must divide [moe] num_experts"),
    ("parallelism", "expert_parallel_degree", 0, "[parallelism] expert_parallel_degree = 0: must be >= 1"),
    ("parallelism", "tensor_parallel_degree", 2, "[parallelism] tensor_parallel_degree = 2: qwen3_moe supports FSDP and EP only"),
    ("parallelism", "pipeline_parallel_degree", 2, "[parallelism] pipeline_parallel_degree = 2"),
    ("parallelism", "context_parallel_degree", 2, "[parallelism] context_parallel_degree = 2"),
    ("parallelism", "expert_tensor_parallel_degree", 2, "[parallelism] expert_tensor_parallel_degree = 2: only 1"),
    ("parallelism", "data_parallel_shard_degree", 0, "[parallelism] data_parallel_shard_degree = 0: must be -1"),
    ("dispatch", "num_sms", 7, "[dispatch] num_sms = 7: must be 0"),
    ("dispatch", "tuned_file", "typo.json", "[dispatch] tuned_file = 'typo.json': no such file"),
    ("dispatch", "tuned_file", DEBUG, "[dispatch] tuned_file = '" + DEBUG + "': cannot read it as JSON"),
    ("kernels", "backend", "triton", "[kernels] backend = 'triton' needs a CUDA GPU"),
    ("checks", "hang_timeout", -5.0, "[checks] hang_timeout = -5.0: must be seconds > 0, 0 (off) or -1"),
    ("data", "workers", -1, "[data] workers = -1: must be >= 0"),
]

# Values of the wrong type or outside a key's choices: TOML and flag each say what the key takes.
TYPES = [
    ("training", "steps", "abc", "[training] steps", "int"),
    ("optimizer", "lr", "fast", "[optimizer] lr", "float"),
    ("moe", "top_k", "two", "[moe] top_k", "int"),
    ("router", "score_func", "relu", "[router] score_func", "'softmax' | 'sigmoid'"),
    ("dispatch", "backend", "nvshmem", "[dispatch] backend", "'auto' | 'local' | 'all_to_all' | 'deepep'"),
    ("dispatch", "buffers", "huge", "[dispatch] buffers", "'exact' | 'worst_case'"),
    ("dispatch", "overlap", "both", "[dispatch] overlap", "'none' | 'chunks'"),
    ("dispatch", "recompute", "again", "[dispatch] recompute", "'replay' | 'exchange'"),
    ("kernels", "backend", "cuda", "[kernels] backend", "'auto' | 'torch' | 'triton'"),
    ("moe", "padding", "sometimes", "[moe] padding", "'none' | 'auto' | 'always'"),
    ("router", "balance_loss", "batch", "[router] balance_loss", "'none'"),
    ("checks", "router_init", "maybe", "[checks] router_init", "'error'"),
    ("activation_checkpoint", "mode", "some", "[activation_checkpoint] mode", "'selective'"),
    ("training", "mixed_precision_param", "float16", "[training] mixed_precision_param", "'bfloat16'"),
    ("optimizer", "moments_dtype", "float16", "[optimizer] moments_dtype", "'float32' | 'bfloat16'"),
    ("optimizer", "update", "cuda", "[optimizer] update", "'auto' | 'torch' | 'triton'"),
    ("optimizer", "expert_grad_dtype", "float16", "[optimizer] expert_grad_dtype", "'auto' | 'float32' | 'bfloat16'"),
    ("training", "on_nonfinite", "maybe", "[training] on_nonfinite", "'stop' | 'skip_step' | 'warn'"),
]

# Everything else that names a key: unknown sections and keys, replaced keys, and combinations.
OTHERS = [
    (["--trainig.steps", "3"], "unknown section 'trainig'"),
    (["--training.stepz", "3"], "unknown key 'stepz' in [training]"),
    (["--router.aux_loss_coeff", "0.1"], "[router] aux_loss_coeff was replaced by"),
    (["--checkpoint.enable", "--checkpoint.interval", "0"], "[checkpoint] interval = 0: must be >= 1"),
    (["--checkpoint.enable", "--checkpoint.keep_latest_k", "1"], "[checkpoint] keep_latest_k = 1: must be 0"),
    (["--checkpoint.enable", "--checkpoint.load_step", "-2"], "[checkpoint] load_step = -2: must be -1"),
    (["--checkpoint.last_save_in_hf"], "[checkpoint] last_save_in_hf = true saves the last step as weights only"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--router.bias_update_rate", "1e-3"],
     "[checkpoint] last_save_in_hf = true with [router] bias_update_rate"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--router.n_groups", "2"],
     "[checkpoint] last_save_in_hf = true with [router] n_groups = 2, topk_groups = 1"),
    (["--router.balance_loss_coeff", "0"], "[router] balance_loss = 'global_batch' needs balance_loss_coeff > 0"),
    (["--router.balance_loss", "none"], "[router] balance_loss_coeff = 0.1 has no loss to weigh"),
    (["--router.n_groups", "4", "--router.topk_groups", "1", "--moe.top_k", "3"], "[moe] top_k = 3: more than topk_groups"),
    (["--router.n_groups", "2", "--router.topk_groups", "2", "--router.force_balance"], "[router] force_balance"),
    (["--dispatch.backend", "local", "--parallelism.expert_parallel_degree", "2"], "[dispatch] backend = 'local' needs"),
    (["--dispatch.backend", "all_to_all"], "[dispatch] backend = 'all_to_all' needs [parallelism] expert_parallel_degree > 1"),
    (["--dispatch.backend", "deepep"], "[dispatch] backend = 'deepep' needs [parallelism] expert_parallel_degree 2, 4 or 8"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "2"],
     "[dispatch] backend = 'deepep' needs [training] mixed_precision_param = 'bfloat16'"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "2"], "[dispatch] backend = 'deepep': the deep_ep package cannot be imported"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "4", "--nproc-per-node", "2"], "EP would span nodes (2 processes per node)"),
    (["--dispatch.backend", "all_gather"], "[dispatch] backend = 'all_gather' needs [parallelism] "
     "expert_parallel_degree = 2 (every token goes to every EP rank), got 1"),
    (["--dispatch.backend", "all_gather", "--parallelism.expert_parallel_degree", "2", "--dispatch.overlap", "chunks"],
     "[dispatch] backend = 'all_gather' needs [dispatch] overlap = 'none' (its exchanges finish where they start)"),
    (["--dispatch.num_sms", "32", "--dispatch.backend", "all_to_all", "--parallelism.expert_parallel_degree", "2"],
     "[dispatch] num_sms = 32 sets DeepEP's SMs"),
    (["--dispatch.overlap", "chunks"], "[dispatch] overlap = 'chunks' overlaps the exchanges between EP ranks: it needs "
     "[parallelism] expert_parallel_degree > 1 (got 1)"),
    (["--dispatch.recompute", "exchange", "--activation_checkpoint.mode", "full"], "[dispatch] recompute = 'exchange' is what an activation-checkpointing "
     "recompute does for the exchanges between EP ranks: it needs [parallelism] expert_parallel_degree > 1 (got 1)"),
    (["--dispatch.recompute", "exchange", "--parallelism.expert_parallel_degree", "2", "--nproc", "2",
      "--activation_checkpoint.mode", "none"], "and [activation_checkpoint] mode 'full' or 'selective' (got 'none')"),
    (["--parallelism.expert_parallel_degree", "4", "--nproc", "2"], "must divide the FSDP group size (2 of 2 processes)"),
    (["--parallelism.data_parallel_replicate_degree", "3", "--nproc", "2"],
     "[parallelism] data_parallel_replicate_degree = 3: must divide the number of processes (2)"),
    (["--parallelism.data_parallel_replicate_degree", "3", "--parallelism.data_parallel_shard_degree", "2", "--nproc", "4"],
     "must equal the number of processes (4)"),
    (["--training.max_skipped_steps", "0"], "[training] max_skipped_steps = 0: must be >= 1"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "[parallelism] data_parallel_replicate_degree = 0: must be >= 1"),
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "4", "--nproc", "4"],
     "EP splits one replica's FSDP group (2 of 4 processes; torchtitan's mesh is dp_replicate x efsdp x ep)"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "12", "--nproc-per-node", "6"], "EP would span nodes (6 processes per node)"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--parallelism.data_parallel_replicate_degree", "2", "--nproc", "8", "--nproc-per-node", "2"],
     "EP would span nodes (2 processes per node); use 'all_to_all' or 'auto'"),
    (["--training.global_batch_size", "24", "--nproc", "2"], "[training] global_batch_size = 24: must be a multiple"),
    (["--training.dataset", "text", "--training.dataset_path", "/nonexistent"], "[training] dataset_path = '/nonexistent'"),
    (["--nproc", "0"], "--nproc '0': must be a number of processes >= 1"),
    (["--model.init_from", "qwen3_moe"], "[model] init_from = 'qwen3_moe' is for the torchtitan_qwen3_moe baseline"),
    (["--router.gate_precision", "bf16"], "[router] gate_precision"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.name", "Adam"],
     "[optimizer] moments_dtype = 'bfloat16' is for name = 'AdamW' (got 'Adam')"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.early_step_in_backward"],
     "[optimizer] moments_dtype = 'bfloat16' with early_step_in_backward = true"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.update", "torch"],
     "[optimizer] update = 'torch' with moments_dtype = 'bfloat16': torch's AdamW keeps fp32 moments"),
    (["--optimizer.update", "triton", "--optimizer.name", "Adam"], "[optimizer] update = 'triton' is for name = 'AdamW'"),
    (["--optimizer.update", "triton", "--optimizer.early_step_in_backward"],
     "[optimizer] update = 'triton' with early_step_in_backward = true"),
    (["--optimizer.expert_grad_dtype", "bfloat16"],
     "[optimizer] expert_grad_dtype = 'bfloat16' keeps the experts' gradients on their bf16 working copies: needs "
     "[training] mixed_precision_param = 'bfloat16'"),
    (["--optimizer.expert_grad_dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16", "--optimizer.update",
      "torch"], "[optimizer] expert_grad_dtype = 'bfloat16' is read by our AdamW"),
    (["--optimizer.expert_grad_dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16",
      "--training.global_batch_size", "32", "--nproc", "2"],
     "[optimizer] expert_grad_dtype = 'bfloat16' keeps one backward's gradients: global_batch_size = 32 accumulates 2"),
    (["--parallelism.embedding", "rows", "--parallelism.data_parallel_replicate_degree", "2"],
     "[parallelism] embedding = 'rows' shards the embedding over the FSDP ranks of one replica"),
    (["--parallelism.router", "rows", "--parallelism.data_parallel_replicate_degree", "2"],
     "[parallelism] router = 'rows' shards each router's gate over the FSDP ranks of one replica"),
    (["--job.custom_config_module", "my.module"], "[job] custom_config_module = 'my.module'"),
    # The process counts check_config is given (scripts/train.sh and the SLURM script pass them).
    (["--nproc", "2", "--nproc-per-node", "3"], "--nproc-per-node 3: more than --nproc 2"),
    (["--nproc", "6", "--nproc-per-node", "4"], "--nproc 6: not a multiple of --nproc-per-node 4"),
    (["--nproc-per-node", "2"], "--nproc-per-node 2 without --nproc"),
    (["--parallelism.expert_parallel_degree", "4"], "[parallelism] asks for 4 or more processes"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "[parallelism] asks for 2 or more processes"),
    (["--training.dataset_path", "/tmp"], "[training] dataset_path = '/tmp' is not read: dataset = 'synthetic'"),
    (["--model.init_from", "qwen3_moe", "--model.name", "torchtitan_qwen3_moe", "--debug.seed", "None"],
     "[model] init_from = 'qwen3_moe' needs [debug] seed"),
    (["--router.n_groups", "4", "--router.topk_groups", "3", "--moe.top_k", "2"], "[router] topk_groups = 3: more than top_k"),
    (["--checkpoint.initial_load_in_hf", "--checkpoint.no-initial-load-model-only"],
     "[checkpoint] initial_load_in_hf = true loads weights only"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--router.score_func", "sigmoid"],
     "[checkpoint] last_save_in_hf = true: Hugging Face Qwen3-MoE routes with score_func = 'softmax'"),
    (["--parallelism.data_parallel_shard_degree", "3", "--parallelism.expert_parallel_degree", "2"],
     "[parallelism] expert_parallel_degree = 2: must divide data_parallel_shard_degree (3)"),
    (["--dispatch.num_sms", "3"], "[dispatch] num_sms = 3: must be 0"),
    (["--data.attention", "document"], "[data] attention = 'document' needs documents: [training] dataset = 'shards'"),
    (["--activation_checkpoint.offload_inputs"], "[activation_checkpoint] offload_inputs = true offloads what full "
     "recompute keeps, each block's input: it needs mode = 'full' (got 'none')"),
    (["--activation_checkpoint.offload_inputs", "--activation_checkpoint.mode", "full", "--training.local_batch_size",
      "100000000", "--nproc", "2"], "[activation_checkpoint] offload_inputs = true pins 36621 GiB of host memory on "
     "this node (2 ranks x every block's input but the last's), over 75% of its"),
    (["--activation_checkpoint.offload_attention", "--activation_checkpoint.mode", "full"],
     "[activation_checkpoint] offload_attention = true sends the attention's outputs to host memory with each block's "
     "input: it needs offload_inputs = true"),
    (["--activation_checkpoint.offload_attention", "--activation_checkpoint.offload_inputs",
      "--activation_checkpoint.mode", "full", "--data.attention", "document", "--training.dataset", "shards"],
     "[activation_checkpoint] offload_attention = true keeps causal attention's outputs: it needs [data] attention = "
     "'causal' (got 'document')"),
]

# Refusals of what the environment says, with the config (the variables set for the case only).
ENVIRONMENT = [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, [],
     "[training] expandable_segments = true but PYTORCH_CUDA_ALLOC_CONF says 'expandable_segments:False'"),
]

# python -m torchtitan_moe.tools.plan's flags (after the config file).
PLAN = [
    ([], "--nodes is missing: a number of nodes >= 1"),
    (["--nodes", "0", "--gpus-per-node", "8"], "--nodes '0': must be a number of nodes >= 1"),
    (["--nodes", "2"], "--gpus-per-node is missing: a number of GPUs per node >= 1"),
    (["--nodes", "2", "--gpus-per-node", "eight"], "--gpus-per-node 'eight': must be a number of GPUs per node >= 1"),
    (["--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100"], "--gpu 'a100': expected one of h200, h100, b200"),
    (["--nodes", "1", "--gpus-per-node", "8", "--global-batch", "-4096"], "--global-batch '-4096': must be a number of tokens >= 1"),
    (["--nodes", "1", "--gpus-per-node", "2", "--global-batch", "1000"],
     "--global-batch 1000: must be a multiple of GPUs x seq_len x local_batch_size (2 x 128 x 8 = 2048 tokens)"),
    (["--nodes", "1", "--gpus-per-node", "2", "--training.seq_len", "1"], "[training] seq_len = 1: must be >= 2"),
    (["--nodes", "1", "--gpus-per-node", "8", "--model.name", "torchtitan_qwen3_moe"],
     "[model] name = 'torchtitan_qwen3_moe': the planner knows 'qwen3_moe'"),
]



# ---------------------------------------------------------------------------------------------------------
# Files the cases below break: a run folder with two saved steps, a Hugging Face folder, text data.
# ---------------------------------------------------------------------------------------------------------


def debug_args():
    from torchtitan_moe.models.qwen3_moe import flavor_args
    from torchtitan_moe.train.job_config import load_job_config

    args = flavor_args("debug")
    args.update_from_config(load_job_config(["--job.config_file", DEBUG]))
    return args


def save_step(folder: Path, step: int | None, dp_ranks: int = 1, bias: float = 0.0) -> None:
    """A step folder as the trainer saves it (DCP with checksums.json, model_args.json): the debug model's
    weights (the routers' expert bias `bias`), and unless `step` is None its step and the data positions of
    `dp_ranks` ranks."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_moe.train.checkpoint import expected_shapes, write_model_args
    from torchtitan_moe.train.checksums import ChecksummedWriter

    args = debug_args()
    g = torch.Generator().manual_seed(step or 0)
    state = {k: torch.randn(shape, generator=g) * 0.02 * (not k.endswith("expert_bias"))  # HF exports no bias
             for k, shape in expected_shapes(args).items()}
    state |= {k: torch.full_like(v, bias) for k, v in state.items() if k.endswith("expert_bias")}
    if step is not None:
        state["train_state"] = {"step": step, "ntokens_seen": 1024 * step}
        state["dataloader"] = {f"dp_rank_{r}": pickle.dumps({"sample_idx": step}) for r in range(dp_ranks)}
    dcp.save(state, storage_writer=ChecksummedWriter(str(folder)), no_dist=True)
    write_model_args(str(folder), args)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Templates the cases copy: run/checkpoint/step-{2,4}, hf/ (step 4 exported), model_only/ (a step 0)."""
    root = tmp_path_factory.mktemp("templates")
    with contextlib.redirect_stderr(io.StringIO()):
        for step in (2, 4):
            save_step(root / "run" / "checkpoint" / f"step-{step}", step)
        save_step(root / "model_only", None)
        save_step(root / "biased", 8, bias=0.01)
        convert.to_hf(str(root / "run" / "checkpoint" / "step-4"), str(root / "hf"), debug_args(),
                      dtype=torch.float32, show_progress=False)
    return root


def step_file(run: Path, step: int, name: str = "__0_0.distcp") -> Path:
    return run / "checkpoint" / f"step-{step}" / name


def flip(path: Path, at: float = 0.5, n: int = 64) -> None:
    """Random bytes over n bytes in the middle of a file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + n] = os.urandom(n)
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def text_files(folder: Path, **named: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in named.items():
        (folder / name.replace("__", ".")).write_bytes(content)
    return str(folder)


def run(tmp: Path, files: Path, *extra: str) -> list[str]:
    """check_config's argv for a copy of the template run folder (tmp/run), checkpointing on."""
    if not (tmp / "run").exists():
        shutil.copytree(files / "run", tmp / "run")
    return [DEBUG, "--job.dump_folder", str(tmp / "run"), "--checkpoint.enable", *extra]


def text(tmp: Path, path: str, *extra: str) -> list[str]:
    return [DEBUG, "--job.dump_folder", str(tmp / "out"), "--training.dataset", "text", "--training.dataset_path",
            path, *extra]


def hold_lock(folder: Path, **holder) -> None:
    from torchtitan_moe.train.run_folder import LOCK_FILE

    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **holder}))


def tuned(tmp: Path, change) -> list[str]:
    """A tuned dispatch file: the shipped table's first entry, changed by change(data)."""
    data = json.loads((PACKAGE / "parallel" / "tuned_dispatch.json").read_text())
    data["entries"] = data["entries"][:1]
    change(data)
    (tmp / "tuned.json").write_text(json.dumps(data))
    return [DEBUG, "--dispatch.tuned_file", str(tmp / "tuned.json")]


def entry(**changes):
    def change(data):
        data["entries"][0].update(changes)
        for key, value in changes.items():
            if value is None:
                del data["entries"][0][key]
    return change


def put(path: Path, content: bytes | str) -> str:
    """Write `content` to `path` (its folder made); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def writes(content: bytes | str):
    return lambda path: put(path, content)


def zero_head(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(bytes(256) + data[256:])


def append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"x" * 9)


def broken_run(tmp: Path, files: Path, breaks: dict, *extra: str) -> list[str]:
    """run(), with breaks[(step, file)](path) applied to the copied run's step files."""
    argv = run(tmp, files, *extra)
    for (step, name), breaking in breaks.items():
        breaking(step_file(tmp / "run", step, name))
    return argv


def with_step(tmp: Path, files: Path, template: str, *extra: str, index: bool = False) -> list[str]:
    """run(), with a step-6 copied from the template folder `template` (index: made a Hugging Face export)."""
    argv = run(tmp, files, *extra)
    shutil.copytree(files / template, tmp / "run" / "checkpoint" / "step-6")
    if index:
        put(tmp / "run" / "checkpoint" / "step-6" / "model.safetensors.index.json", "{}")
    return argv


def lost_file(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["files"]["__9_0.distcp"] = {"size": 1, "chunks": ["0"]}
    path.write_text(json.dumps(manifest))


D = "__0_0.distcp"
# (id, build(tmp, files) -> check_config's argv, what the line must say). Nothing under tmp may change.
FILES = [
    # Configs that are not UTF-8, or not files
    ("toml binary", lambda t, f: [put(t / "c.toml", bytes(range(256)))], "c.toml:2: not UTF-8 text (byte 0x80)"),
    ("toml UTF-16", lambda t, f: [put(t / "c.toml", "[job]\n".encode("utf-16"))], "c.toml:1: not UTF-8 text (byte 0xff)"),
    ("toml Latin-1", lambda t, f: [put(t / "c.toml", b"[job]\n# caf\xe9\n")], "c.toml:2: not UTF-8 text (byte 0xe9)"),
    ("toml a folder", lambda t, f: [str(t)], f"--job.config_file "),
    ("toml not TOML", lambda t, f: [put(t / "c.toml", "[job\n")], "c.toml: not valid TOML"),
    ("toml no such file", lambda t, f: [str(t / "missing.toml")], "missing.toml: no such file"),
    ("toml unknown section", lambda t, f: [put(t / "c.toml", "[trainig]\nsteps = 3\n")], "unknown section [trainig]"),
    ("toml section not a table", lambda t, f: [put(t / "c.toml", "job = 3\n")], "[job] must be a table of keys, got 3"),
    ("toml unknown key", lambda t, f: [put(t / "c.toml", "[training]\nstepz = 3\n")], "unknown key [training] stepz"),
    # Text data: every file and record, read as the ranks will
    ("data empty folder", lambda t, f: text(t, text_files(t / "d")), "no .txt or .jsonl files"),
    ("data binary .txt", lambda t, f: text(t, text_files(t / "d", a__txt=b"ok\n" + bytes(range(128, 256)))),
     "a.txt:2: not UTF-8 text (byte 0x80)"),
    ("data Latin-1 .txt", lambda t, f: text(t, text_files(t / "d", a__txt=b"one\ntwo\ncaf\xe9\n")),
     "a.txt:3: not UTF-8 text (byte 0xe9)"),
    ("data UTF-16 .txt", lambda t, f: text(t, text_files(t / "d", a__txt="hello".encode("utf-16"))),
     "a.txt:1: not UTF-8 text (byte 0xff)"),
    ("data malformed .jsonl", lambda t, f: text(t, text_files(t / "d", b__jsonl=b'{"text": "a"}\n{"text": "b\n')),
     "b.jsonl:2: not a JSON record"),
    ("data .jsonl without text", lambda t, f: text(t, text_files(t / "d", b__jsonl=b'{"body": "a"}\n')),
     "b.jsonl:1: a JSONL record needs a 'text' field"),
    ("data .jsonl text not a string", lambda t, f: text(t, text_files(t / "d", b__jsonl=b'\n{"text": 3}\n')),
     "b.jsonl:2: a JSONL record needs a 'text' field"),
    ("data .jsonl record a list", lambda t, f: text(t, text_files(t / "d", b__jsonl=b'["text"]\n')),
     "b.jsonl:1: a JSONL record needs a 'text' field"),
    ("data .jsonl not UTF-8", lambda t, f: text(t, text_files(t / "d", b__jsonl=b'{"text": "a"}\n\n{"text": "\xff"}\n')),
     "b.jsonl:3: not UTF-8 text (byte 0xff)"),
    ("data second file bad", lambda t, f: text(t, text_files(t / "d", a__txt=b"fine", z__jsonl=b"{\n")),
     "z.jsonl:1: not a JSON record"),
    ("data fewer documents than ranks", lambda t, f: text(t, text_files(t / "d", a__txt=b"one"), "--nproc", "2"),
     "1 documents for 2 data-parallel ranks"),
    ("data tokenizer larger than the model", lambda t, f: text(t, text_files(t / "d", a__txt=b"one"), "--data.tokenizer",
                                                              big_tokenizer(t / "tok.json")),
     "has 3001 tokens but the model's vocab_size is 2048"),
    # Token shards' sources ([data] sources: a TOML list of tables)
    ("data sources without shards", lambda t, f: sources(t, f'{{path = "{t}"}}'),
     "[data] sources are read by [training] dataset = 'shards' (this run's is 'synthetic')"),
    ("data source without a path", lambda t, f: sources(t, '{folder = "x"}', "--training.dataset", "shards"),
     "[data] sources[0] = {'folder': 'x'}: expected {path = \"FOLDER\", weight = W}"),
    ("data source weight", lambda t, f: sources(t, f'{{path = "{t}", weight = -1}}', "--training.dataset", "shards"),
     "[data] sources[0] weight = -1 (path "),
    ("data source missing", lambda t, f: sources(t, '{path = "/nonexistent"}', "--training.dataset", "shards"),
     "[data] sources[0] path = '/nonexistent': no such file or folder"),
    # The run folder: one writer at a time
    ("lock held here", lambda t, f: held(t, {}), f"is in use by another run (host {socket.gethostname()} pid {os.getpid()}"),
    ("lock held elsewhere", lambda t, f: held(t, {"host": "node-17", "pid": 4242}),
     "is in use by another run (host node-17 pid 4242"),
    # The checkpoint a run would load: metadata, data files, checksums, shapes, data positions
    ("ckpt random bytes in a .distcp", lambda t, f: broken_run(t, f, {(4, D): flip}), "step-4/__0_0.distcp is corrupt: its bytes 0.."),
    ("ckpt newest good step named", lambda t, f: broken_run(t, f, {(4, D): flip}),
     "; resume from step 2 with --checkpoint.load_step 2"),
    ("ckpt every step corrupt", lambda t, f: broken_run(t, f, {(4, D): flip, (2, D): flip}),
     "no earlier full step to resume from: start over in a new --job.dump_folder"),
    ("ckpt zeroed .distcp header", lambda t, f: broken_run(t, f, {(4, D): zero_head}), "step-4/__0_0.distcp is corrupt"),
    ("ckpt truncated .distcp", lambda t, f: broken_run(t, f, {(4, D): truncate}), "step-4/__0_0.distcp is truncated"),
    ("ckpt missing .distcp", lambda t, f: broken_run(t, f, {(4, D): Path.unlink}), "step-4/__0_0.distcp is missing"),
    ("ckpt bytes appended", lambda t, f: broken_run(t, f, {(4, D): append}), "bytes where"),
    ("ckpt .metadata garbage", lambda t, f: broken_run(t, f, {(4, ".metadata"): writes("garbage")}),
     "step-4: its .metadata cannot be read"),
    ("ckpt checksums.json garbage", lambda t, f: broken_run(t, f, {(4, "checksums.json"): writes("{")}),
     "checksums.json cannot be read (JSONDecodeError"),
    ("ckpt checksums.json other hash", lambda t, f: broken_run(t, f, {(4, "checksums.json"): writes(
        '{"algorithm": "md5", "chunk_bytes": 1, "files": {}}')}), "algorithm 'md5', expected 'xxh3_64'"),
    ("ckpt checksums list a lost file", lambda t, f: broken_run(t, f, {(4, "checksums.json"): lost_file}),
     "__9_0.distcp is missing (listed in checksums.json)"),
    ("ckpt model_args.json garbage", lambda t, f: broken_run(t, f, {(4, "model_args.json"): writes("[1")}),
     "model_args.json cannot be read"),
    ("ckpt load_step not saved", lambda t, f: run(t, f, "--checkpoint.load_step", "3"), "--checkpoint.load_step 3: "),
    ("ckpt load_step incomplete", lambda t, f: broken_run(t, f, {(6, D): lambda p: put(p, b"x")}, "--checkpoint.load_step",
                                                          "6"), "step-6 is incomplete (no .metadata"),
    ("ckpt other architecture", lambda t, f: run(t, f, "--moe.num_experts", "16"),
     "does not fit this run: num_experts 8 vs 16 (checkpoint vs this run); set [moe] num_experts"),
    ("ckpt other data-parallel degree", lambda t, f: run(t, f, "--nproc", "2"),
     "holds the data positions of 1 data-parallel ranks and this run has 2"),
    ("ckpt model only resumed", lambda t, f: with_step(t, f, "model_only"),
     "step-6 holds the model only (no optimizer, step or data position)"),
    ("ckpt HF export resumed", lambda t, f: with_step(t, f, "hf", index=True),
     "step-6 is a Hugging Face export (weights only): it cannot resume training"),
    ("ckpt initial load missing", lambda t, f: [DEBUG, "--job.dump_folder", str(t / "new"), "--checkpoint.enable",
                                                "--checkpoint.initial_load_path", str(t / "nope")],
     "--checkpoint.initial_load_path: "),
    ("hf config.json not JSON", lambda t, f: hf_load(t, f, lambda h: put(h / "config.json", "{,")),
     "config.json cannot be read as JSON"),
    ("hf config.json a list", lambda t, f: hf_load(t, f, lambda h: put(h / "config.json", "[]")),
     "config.json: expected a JSON object, found list"),
    ("hf no config.json", lambda t, f: hf_load(t, f, lambda h: (h / "config.json").unlink()),
     "no config.json (a Hugging Face Qwen3-MoE folder has one)"),
    ("hf truncated safetensors", lambda t, f: hf_load(t, f, lambda h: truncate(h / "model.safetensors")),
     "model.safetensors is not a readable safetensors file"),
    ("hf other architecture", lambda t, f: hf_load(t, f, lambda h: None, "--moe.inter_dim", "64"),
     "does not fit this run: inter_dim 128 vs 64"),
    # A tuned dispatch file that does not parse
    ("tuned not a table", lambda t, f: tuned(t, lambda d: d.update(entries=[3])), "entry 0: expected a table, got 3"),
    ("tuned missing key", lambda t, f: tuned(t, entry(best=None)), "entry 0: missing key 'best'"),
    ("tuned bad number", lambda t, f: tuned(t, entry(ep="two")), "entry 0: invalid literal for int()"),
    ("tuned best unknown", lambda t, f: tuned(t, entry(best="nccl")), "entry 0: best = 'nccl': expected one of"),
    ("tuned best untimed", lambda t, f: tuned(t, entry(best="all_gather")), "best = 'all_gather' has no time in layer_ms"),
    ("tuned deepep settings", lambda t, f: tuned(t, entry(deepep={"num_sms": 3, "dispatch_chunk": 8, "combine_chunk": 8,
                                                                   "buffer_tokens": 256})), "entry 0: deepep num_sms = 3"),
    ("tuned no entries", lambda t, f: tuned(t, lambda d: d.pop("entries")), 'expected {"version": 1, "entries": [...]}'),
    ("tuned other version", lambda t, f: tuned(t, lambda d: d.update(version=9)), "version 9, this code reads 1"),
]


def big_tokenizer(path: Path) -> str:
    """A word-level tokenizer.json of 3,001 tokens (more than the debug model's vocabulary)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(3000)} | {"<|endoftext|>": 3000}
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(path))
    return str(path)


def sources(tmp: Path, *tables_and_flags: str) -> list[str]:
    """The debug config with [data] sources = [tables_and_flags[0]], and the flags after it."""
    table, *flags = tables_and_flags
    return [put(tmp / "c.toml", Path(DEBUG).read_text() + f"\n[data]\nsources = [{table}]\n"), *flags]


def held(tmp: Path, holder: dict) -> list[str]:
    hold_lock(tmp / "r", **holder)
    return [DEBUG, "--job.dump_folder", str(tmp / "r")]


def hf_load(tmp: Path, files: Path, change, *extra: str) -> list[str]:
    shutil.copytree(files / "hf", tmp / "hf")
    change(tmp / "hf")
    return [DEBUG, "--job.dump_folder", str(tmp / "new"), "--checkpoint.enable", "--checkpoint.initial_load_path",
            str(tmp / "hf"), "--checkpoint.initial_load_in_hf", *extra]


def to_hf(tmp: Path, files: Path, *extra: str, step: int = 4, change=None) -> list[str]:
    shutil.copytree(files / "run", tmp / "run")
    if change:
        change(tmp / "run" / "checkpoint" / f"step-{step}")
    return ["to-hf", str(tmp / "run" / "checkpoint" / f"step-{step}"), str(tmp / "out"), *extra]


def from_hf(tmp: Path, files: Path, *extra: str, change=None) -> list[str]:
    shutil.copytree(files / "hf", tmp / "hf")
    if change:
        change(tmp / "hf")
    return ["from-hf", str(tmp / "hf"), str(tmp / "out"), *extra]


# convert: (id, build(tmp, files) -> argv, what its one line must say). OUT (tmp/out) must not appear.
CONVERT = [
    ("to-hf no such folder", lambda t, f: ["to-hf", str(t / "nope"), str(t / "out")], "nope: no such folder"),
    ("to-hf not a checkpoint", lambda t, f: ["to-hf", str(t), str(t / "out")], "not a complete DCP checkpoint"),
    ("to-hf truncated", lambda t, f: to_hf(t, f, change=lambda s: truncate(s / "__0_0.distcp")), "is truncated"),
    ("to-hf random bytes", lambda t, f: to_hf(t, f, change=lambda s: flip(s / "__0_0.distcp")), "is corrupt"),
    ("to-hf .metadata garbage", lambda t, f: to_hf(t, f, change=lambda s: (s / ".metadata").write_bytes(b"\0" * 40)),
     "its .metadata cannot be read"),
    ("to-hf no model_args.json", lambda t, f: to_hf(t, f, change=lambda s: (s / "model_args.json").unlink()),
     "has no model_args.json: pass --config"),
    ("to-hf --shard-gb 0", lambda t, f: to_hf(t, f, "--shard-gb", "0"), "--shard-gb 0.0: must be > 0"),
    ("to-hf --shard-gb -1", lambda t, f: to_hf(t, f, "--shard-gb", "-1"), "--shard-gb -1.0: must be > 0"),
    ("to-hf --shard-gb nan", lambda t, f: to_hf(t, f, "--shard-gb", "nan"), "--shard-gb nan: must be > 0"),
    ("to-hf --num-experts 0", lambda t, f: to_hf(t, f, "--num-experts", "0"), "--num-experts 0: must be >= 1"),
    ("to-hf --top-k -1", lambda t, f: to_hf(t, f, "--top-k", "-1"), "--top-k -1: must be >= 1"),
    ("to-hf --num-experts 16", lambda t, f: to_hf(t, f, "--num-experts", "16"), "does not fit the model settings given"),
    ("to-hf --flavor huge", lambda t, f: to_hf(t, f, "--flavor", "huge"), "--flavor huge: expected one of"),
    ("to-hf --dtype int8", lambda t, f: to_hf(t, f, "--dtype", "int8"), "argument --dtype: invalid choice: 'int8'"),
    ("to-hf unknown flag", lambda t, f: to_hf(t, f, "--bogus"), "unrecognized arguments: --bogus"),
    ("to-hf expert bias", lambda t, f: ["to-hf", str(f / "biased"), str(t / "out")],
     "layers.0.moe.router.expert_bias is not zero (max |bias|"),
    ("to-hf bias measured on training data", lambda t, f: ["to-hf", str(f / "biased"), str(t / "out"), "--drop-expert-bias",
                                                          "--config", debug_with(t, training__dataset="text",
                                                                                 training__dataset_path=str(t))],
     "is what the run trained on, not held out: pass --eval-tokens FILE"),
    ("to-hf --eval-batches 0", lambda t, f: to_hf(t, f, "--drop-expert-bias", "--eval-batches", "0"),
     "--eval-batches 0: must be >= 1"),
    ("to-hf --eval-tokens alone", lambda t, f: to_hf(t, f, "--eval-tokens", "x.pt"), "pass them with --drop-expert-bias"),
    ("to-hf OUT a file", lambda t, f: to_hf(t, f)[:2] + [put(t / "file", "x")], "file is a file: the output must be a folder"),
    ("to-hf OUT not empty", lambda t, f: to_hf(t, f)[:2] + [str(Path(put(t / "full" / "x", "x")).parent)],
     "full is not empty"),
    ("from-hf no such folder", lambda t, f: ["from-hf", str(t / "nope"), str(t / "out")], "nope: no such folder"),
    ("from-hf no config.json", lambda t, f: from_hf(t, f, change=lambda h: (h / "config.json").unlink()),
     "hf: no config.json"),
    ("from-hf config.json not JSON", lambda t, f: from_hf(t, f, change=lambda h: put(h / "config.json", b"\xff{")),
     "config.json cannot be read as JSON (UnicodeDecodeError"),
    ("from-hf weights unlike config.json", lambda t, f: from_hf(t, f, change=lambda h: put(h / "config.json", json.dumps(
        {**json.loads((h / "config.json").read_text()), "moe_intermediate_size": 64}))),
     "the weights do not fit its config.json"),
    ("from-hf truncated shard", lambda t, f: from_hf(t, f, change=lambda h: truncate(h / "model.safetensors", 0.9)),
     "model.safetensors is not a readable safetensors file"),
    ("from-hf index not JSON", lambda t, f: from_hf(t, f, change=lambda h: put(h / "model.safetensors.index.json", "{")),
     "model.safetensors.index.json cannot be read as JSON"),
    ("from-hf index without weight_map", lambda t, f: from_hf(
        t, f, change=lambda h: put(h / "model.safetensors.index.json", "{}")), "no 'weight_map' table"),
    ("from-hf no safetensors", lambda t, f: from_hf(t, f, change=lambda h: (h / "model.safetensors").unlink()),
     "no *.safetensors files"),
    ("from-hf --dtype int8", lambda t, f: from_hf(t, f, "--dtype", "int8"), "argument --dtype: invalid choice"),
    ("convert no direction", lambda t, f: [], "the following arguments are required"),
]

# scripts/build_tokenizer.py: (id, build(tmp) -> argv, what its one line must say). tmp/tok.json must not appear.
TOKENIZER = [
    ("--vocab-size 0", lambda t: [text_files(t / "d", a__txt=b"hello"), str(t / "tok.json"), "--vocab-size", "0"],
     "--vocab-size 0: must be >= 257"),
    ("--vocab-size 256", lambda t: [text_files(t / "d", a__txt=b"hello"), str(t / "tok.json"), "--vocab-size", "256"],
     "--vocab-size 256: must be >= 257"),
    ("--vocab-size abc", lambda t: [str(t), str(t / "tok.json"), "--vocab-size", "abc"],
     "argument --vocab-size: invalid int value: 'abc'"),
    ("no such data", lambda t: [str(t / "nope"), str(t / "tok.json")], "nope: no such file or folder"),
    ("empty folder", lambda t: [text_files(t / "d"), str(t / "tok.json")], "no .txt or .jsonl files"),
    ("binary .txt", lambda t: [text_files(t / "d", a__txt=bytes(range(256))), str(t / "tok.json")],
     "a.txt:2: not UTF-8 text (byte 0x80)"),
    ("malformed .jsonl", lambda t: [text_files(t / "d", a__jsonl=b'{"text": 1}\n'), str(t / "tok.json")],
     "a.jsonl:1: a JSONL record needs a 'text' field"),
    ("OUT a folder", lambda t: [text_files(t / "d", a__txt=b"hi"), str(t / "d")], "d is a folder"),
    ("OUT's folder missing", lambda t: [text_files(t / "d", a__txt=b"hi"), str(t / "no" / "tok.json")],
     "does not exist"),
    ("unknown flag", lambda t: [str(t), str(t / "tok.json"), "--bogus", "9"], "unrecognized arguments: --bogus 9"),
]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------
# Running a case: its one line, its exit status, the folders it must leave as they were.
# ---------------------------------------------------------------------------------------------------------

SEEN: dict[str, str] = {}  # case id -> the line it printed (the coverage test reads them)
PREFIX = {"check_config": "config error: ", "plan": "config error: ", "convert": "convert: error: ",
          "build_tokenizer": "build_tokenizer: error: "}


def snapshot(*folders: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folders`: path -> (size, xxh3_64 of its bytes)."""
    out = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")) if Path(folder).exists() else []:
            if path.is_file():
                out[str(path)] = (path.stat().st_size, xxhash.xxh3_64(path.read_bytes()).hexdigest())
    return out


def run_tool(tool, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tool.main(argv)
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return code, out.getvalue(), err.getvalue()


def refuse(case: str, tool, argv: list[str], expected: str, watched=(), absent=(), status: int = 2) -> str:
    """Run `tool.main(argv)`: exit status `status`, one line on stderr that starts with the tool's prefix and
    holds `expected`, nothing on stdout, no traceback, `watched` folders unchanged, `absent` paths not made.
    (A progress bar that ran before the failure is no line: convert draws one while it writes.)"""
    before = snapshot(*watched)
    code, out, err = run_tool(tool, argv)
    name = tool.__name__.rsplit(".", 1)[-1]
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]
    assert code == status, (argv, code, out, err)
    assert len(lines) == 1 and lines[0].startswith(PREFIX[name]), (argv, err)
    assert expected in lines[0], (argv, lines[0])
    assert "Traceback" not in err + out and out == "", (argv, out)
    assert snapshot(*watched) == before, f"{argv}: files changed"
    assert not [p for p in absent if Path(p).exists()], f"{argv}: left {absent}"
    SEEN[case] = lines[0]
    return lines[0]


def value_case(tmp_path: Path, section, key, value, expected) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # a machine without a GPU, as users have (the caller puts it back)
    refuse(f"{section}.{key}={value} toml", check_config, [debug_with(tmp_path, **{f"{section}__{key}": value})], expected)
    refuse(f"{section}.{key}={value} flag", check_config, [DEBUG, f"--{section}.{key}", str(value)], expected)


def type_case(tmp_path: Path, section, key, value, name, allowed) -> None:
    toml = [debug_with(tmp_path, **{f"{section}__{key}": value})]
    assert allowed in refuse(f"{section}.{key} toml", check_config, toml, f"{name} = {value!r}: expected")
    assert allowed in refuse(f"{section}.{key} flag", check_config, [DEBUG, f"--{section}.{key}", value],
                             f"--{section}.{key} {value}: {name} must be")


@pytest.mark.parametrize("section, key, value, expected", VALUES, ids=[f"{s}.{k}={v}" for s, k, v, _ in VALUES])
def test_a_bad_value_is_one_line_in_toml_and_as_a_flag(tmp_path, section, key, value, expected, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))  # put back afterwards
    value_case(tmp_path, section, key, value, expected)


@pytest.mark.parametrize("section, key, value, name, allowed", TYPES, ids=[f"{s}.{k}={v}" for s, k, v, _, _ in TYPES])
def test_a_value_of_the_wrong_type_is_one_line_in_toml_and_as_a_flag(tmp_path, section, key, value, name, allowed):
    type_case(tmp_path, section, key, value, name, allowed)


@pytest.mark.parametrize("overrides, expected", OTHERS, ids=[" ".join(o)[:60] for o, _ in OTHERS])
def test_other_refusals_are_one_line(overrides, expected, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # this machine has no DeepEP, whatever is installed
    refuse(" ".join(overrides), check_config, [DEBUG, *overrides], expected)


@pytest.mark.parametrize("env, overrides, expected", ENVIRONMENT, ids=[str(e) for e, _, _ in ENVIRONMENT])
def test_an_environment_that_contradicts_the_config_is_one_line(env, overrides, expected, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refuse(str(env), check_config, [DEBUG, *overrides], expected)


@pytest.mark.parametrize("flags, expected", PLAN, ids=[" ".join(f)[:60] for f, _ in PLAN])
def test_a_bad_planner_flag_is_one_line(flags, expected):
    refuse("plan " + " ".join(flags), plan, [DEBUG, *flags], expected)


@pytest.mark.parametrize("case, build, expected", FILES, ids=[c for c, _, _ in FILES])
def test_a_bad_file_is_one_line_before_launch_and_nothing_changes(tmp_path, files, case, build, expected):
    argv = build(tmp_path, files)
    refuse(case, check_config, argv, expected, watched=[tmp_path])


@pytest.mark.parametrize("case, build, expected", CONVERT, ids=[c for c, _, _ in CONVERT])
def test_convert_refuses_in_one_line_and_leaves_nothing_behind(tmp_path, files, case, build, expected):
    argv = build(tmp_path, files)
    refuse(case, convert, argv, expected, watched=[tmp_path], absent=[tmp_path / "out"])


@pytest.mark.parametrize("case, build, expected", TOKENIZER, ids=[c for c, _, _ in TOKENIZER])
def test_build_tokenizer_refuses_in_one_line_and_writes_nothing(tmp_path, case, build, expected):
    argv = build(tmp_path)
    refuse(case, load_script("build_tokenizer"), argv, expected, watched=[tmp_path], absent=[tmp_path / "tok.json"])


def test_what_a_run_will_read_passes_the_check_and_nothing_is_written(tmp_path, files):
    # The template run resumes; a lock left by a run that is gone is no refusal (the run takes it over).
    argv = run(tmp_path, files, "--nproc", "1")
    hold_lock(tmp_path / "run", pid=2**22 + 7, started="1")  # above Linux's largest pid: no such process
    before = snapshot(tmp_path)
    code, out, err = run_tool(check_config, argv)
    assert (code, err) == (0, "") and out.startswith("ok: qwen3_moe debug"), (out, err)
    data = text_files(tmp_path / "d", a__txt=b"one", b__jsonl=b'{"text": "two"}\n\n{"text": "three"}\n')
    code, out, err = run_tool(check_config, text(tmp_path, data, "--nproc", "2"))
    assert (code, err) == (0, ""), err
    assert snapshot(tmp_path) == before | snapshot(tmp_path / "d")


def test_a_disk_full_while_converting_is_one_line_and_removes_the_partial_output(tmp_path, files, monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    argv = to_hf(tmp_path, files)
    refuse("to-hf disk full", convert, argv, "No space left on device); what was written is removed",
           watched=[tmp_path / "run"], absent=[tmp_path / "out"])


@pytest.mark.parametrize("error, prefix, status", [
    ("CheckpointError", "checkpoint error: ", 2), ("RunFolderBusy", "config error: ", 2),
    ("DataError", "config error: ", 2), ("NonFiniteError", "stopped: ", 3)])
def test_the_trainer_stops_in_one_line_with_its_exit_status(monkeypatch, error, prefix, status):
    # What a rank finds after launch: its one line and status (the launcher adds nothing for these).
    from torchtitan_moe.components.data.check import DataError
    from torchtitan_moe.train import trainer
    from torchtitan_moe.train.checkpoint import CheckpointError
    from torchtitan_moe.train.divergence import NonFiniteError
    from torchtitan_moe.train.run_folder import RunFolderBusy

    cls = {c.__name__: c for c in (CheckpointError, RunFolderBusy, DataError, NonFiniteError)}[error]
    monkeypatch.setattr(trainer, "prepare", lambda argv: None)
    monkeypatch.setattr(trainer, "run", lambda config: (_ for _ in ()).throw(cls("what happened")))
    monkeypatch.setattr(trainer, "init_logger", lambda: None)
    code, out, err = run_tool(trainer, [])
    assert (code, out, err) == (status, "", f"{prefix}what happened\n")


@pytest.mark.parametrize("exitcode, line, status", [
    (2, None, 2), (3, None, 3), (4, None, 4), (1, None, 1),
    (-9, "train: rank 1 (pid 99) was killed by SIGKILL (out of host memory?); the run stopped", 137),
    (-11, "train: rank 1 (pid 99) was killed by SIGSEGV; the run stopped", 139),
    (7, "train: rank 1 (pid 99) stopped with exit status 7; its output is above", 7)])
def test_the_launcher_adds_at_most_one_line_to_a_failed_run(exitcode, line, status):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan_moe.train.launch import describe_failure

    failure = ProcessFailure(local_rank=1, pid=99, exitcode=exitcode, error_file="/nonexistent")
    assert describe_failure(ChildFailedError("torchtitan_moe.train", {1: failure})) == (line, status)


def test_the_launcher_script_prints_a_refusal_in_one_line_and_launches_nothing(tmp_path):
    # (a refusal a rank finds after launch, one line and no launcher report: tests/test_failures.py's launch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, NPROC="2")
    result = subprocess.run(["bash", "scripts/train.sh", DEBUG, "--optimizer.lr", "-1", "--job.dump_folder",
                             str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "config error: [optimizer] lr = -1.0: must be a number >= 0"]
    assert not any(tmp_path.iterdir())  # no worker started


@pytest.mark.parametrize("args, expected", [
    (["bogus"], "gpu tier: part 'bogus': expected all, kernels, e2e or test paths under tests/"),
    (["tests/test_overlap.py", "tests/nope.py::test_x"],
     "gpu tier: test path 'tests/nope.py::test_x': no such file or directory"),
])
def test_the_gpu_tier_refuses_a_bad_selection_in_one_line(tmp_path, args, expected):
    # before it looks for a GPU: the same line on a CPU machine
    result = subprocess.run(["bash", "scripts/gpu_tests.sh", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert (result.stdout + result.stderr).strip().splitlines() == [expected]


# ---------------------------------------------------------------------------------------------------------
# Every refusal in the source has a case: read from the modules the check (and convert, the planner) runs.
# ---------------------------------------------------------------------------------------------------------

REFUSING = ["config/sections.py", "config/structure.py", "config/torchtitan_keys.py", "train/job_config.py",
            "train/machine.py", "tools/check_config.py", "train/checkpoint.py", "train/checksums.py",
            "components/data/check.py", "components/data/text.py", "train/run_folder.py", "parallel/tuned.py",
            "tools/plan.py", "hf/convert.py"]
ERRORS = {"ConfigError", "CheckpointError", "DataError", "RunFolderBusy", "ConvertError"}
# Refusals no in-process case can reach on this machine (the literal text they hold -> why).
UNREACHABLE = {
    "could not take the lock": "three runs starting on one folder at once, each seeing the others' locks come and go",
    "SMs": "a GPU's SM count (tuned.check_device)",
    "failed (": "a save that fails while a run writes it: tests/test_failures.py (a full disk)",
    "config_file : cannot be read": "a config file this user may not read (the tests run as root)",
}


def refusals(path: Path) -> list[tuple[int, str, str]]:
    """(line, regex, literal text) of each refusal message in a module: the message of `_need(ok, message)`,
    `raise XError(message)` and a string returned by a `*_problem` function; f-string fields match anything."""
    def regex(node) -> tuple[str, str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return re.escape(node.value), node.value
        if isinstance(node, ast.JoinedStr):
            parts = [(re.escape(v.value), v.value) if isinstance(v, ast.Constant) else (".*?", "") for v in node.values]
            return "".join(p for p, _ in parts), "".join(t for _, t in parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            (a, x), (b, y) = regex(node.left), regex(node.right)
            return a + b, x + y
        return ".*?", ""

    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        message = None
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_need" and len(node.args) == 2:
            message = node.args[1]
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", "") in ERRORS:
            message = node.exc.args[0] if node.exc.args else None
        elif isinstance(node, ast.FunctionDef) and node.name.endswith("_problem"):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.JoinedStr):
                    found.append((ret.lineno, *regex(ret.value)))
        if message is not None:
            found.append((node.lineno, *regex(message)))
    return found


def every_case(tmp: Path, files: Path):
    """(id, run) of every case of the tables above, for the ones this pytest run has not run yet."""
    n = iter(range(10**6))

    def fresh() -> Path:
        folder = tmp / f"case-{next(n)}"
        folder.mkdir()
        return folder

    for section, key, value, expected in VALUES:
        yield f"{section}.{key}={value} toml", lambda c=(section, key, value, expected): value_case(fresh(), *c)
    for case in TYPES:
        yield f"{case[0]}.{case[1]} toml", lambda c=case: type_case(fresh(), *c)
    for overrides, expected in OTHERS:
        yield " ".join(overrides), lambda o=overrides, e=expected: refuse(" ".join(o), check_config, [DEBUG, *o], e)
    for env, overrides, expected in ENVIRONMENT:
        yield str(env), lambda v=env, o=overrides, e=expected: with_environment(v, refuse, str(v), check_config,
                                                                                         [DEBUG, *o], e)
    for flags, expected in PLAN:
        yield "plan " + " ".join(flags), lambda o=flags, e=expected: refuse("plan " + " ".join(o), plan, [DEBUG, *o], e)
    for case, build, expected in FILES:
        yield case, lambda c=case, b=build, e=expected: refuse(c, check_config, b(fresh(), files), e)
    for case, build, expected in CONVERT:
        yield case, lambda c=case, b=build, e=expected: refuse(c, convert, b(fresh(), files), e)
    tokenizer = load_script("build_tokenizer")
    for case, build, expected in TOKENIZER:
        yield case, lambda c=case, b=build, e=expected: refuse(c, tokenizer, b(fresh()), e)


def with_environment(env: dict[str, str], fn, *args):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def test_every_refusal_in_the_source_has_a_case(tmp_path, files, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    for case, run_case in every_case(tmp_path, files):
        if case not in SEEN:  # run alone (-k): the cases run here
            run_case()
    assert len(SEEN) >= 150
    lines = list(SEEN.values())
    missing = []
    for module in REFUSING:
        for lineno, pattern, literal in refusals(PACKAGE / module):
            if len(literal.strip()) < 8 or any(key in literal for key in UNREACHABLE):
                continue  # a message passed on from elsewhere (its own refusal is listed there), or unreachable here
            if not any(re.search(pattern, line) for line in lines):
                missing.append(f"{module}:{lineno}: {literal[:100]!r}")
    assert not missing, "refusals without a case in tests/test_bad_inputs.py:\n" + "\n".join(missing)
