"""Convert between our DCP checkpoints and Hugging Face Qwen3-MoE folders (safetensors + config.json).

    python -m torchtitan_moe.hf.convert to-hf CHECKPOINT OUT [--dtype bfloat16]
        [--config RUN.toml | --flavor NAME [--num-experts N] [--top-k K] [--inter-dim I]]
        [--drop-expert-bias [--eval-tokens FILE] [--eval-batches 8]]
    python -m torchtitan_moe.hf.convert from-hf HF_FOLDER OUT [--dtype float32]

to-hf reads one of our step folders (full or model-only, saved at any FSDP/EP layout: DCP keeps
global tensors) one layer at a time and writes safetensors shards of at most --shard-gb, their
index and config.json: `transformers` loads the folder with `from_pretrained`. The model's
settings come from the step folder's model_args.json (our trainer writes one with every save),
else from --config (the run's TOML) or --flavor; the checkpoint's shapes must fit them.
A checkpoint trained with the expert bias (aux-loss-free balancing) is refused: Hugging Face
Qwen3-MoE has none. --drop-expert-bias exports it anyway and first measures and prints what that
costs (bias_cost.py) on held-out tokens: the run's synthetic stream (--config) or --eval-tokens.

from-hf writes a model-only DCP checkpoint (with its model_args.json); a run starts from it with
`--checkpoint.initial_load_path OUT`. A run also reads a Hugging Face folder as it is:
`--checkpoint.initial_load_path HF_FOLDER --checkpoint.initial_load_in_hf`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_moe.hf.bias_cost import BiasCost, measure_bias_cost, synthetic_held_out, token_file_batches
from torchtitan_moe.train.checkpoint import (
    check_checksums,
    check_data_files,
    check_safetensors,
    model_shapes,
    read_dcp_metadata,
    read_json,
    read_model_args,
    shape_mismatch,
    write_model_args,
)
from torchtitan_moe.train.checksums import ChecksummedWriter
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.models.qwen3_moe import FLAVORS, flavor_args
from torchtitan_moe.models.qwen3_moe.args import Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import (
    HFConversionError,
    Qwen3MoEStateDictAdapter,
    args_from_hf_config,
    check_exportable,
    hf_config,
    matching_flavor,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_BATCHES = 8  # default --eval-batches
NEED_HELD_OUT = ("--drop-expert-bias measures what dropping the bias costs on held-out tokens first: pass --config "
                 "RUN.toml (the run's synthetic stream) or --eval-tokens FILE")


class ConvertError(ValueError):
    """A conversion that cannot be done as asked (one line: what, and what to pass instead)."""


# ---------------------------------------------------------------------------------------
# Progress: tqdm when it is installed, else one line rewritten in place.
# ---------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, items, desc: str):
        self.items, self.desc = list(items), desc

    def __iter__(self):
        total = len(self.items)
        for i, item in enumerate(self.items):
            yield item
            done = (i + 1) * 30 // max(total, 1)
            print(f"\r{self.desc} [{'#' * done}{'.' * (30 - done)}] {i + 1}/{total}", end="", file=sys.stderr)
        print(file=sys.stderr)


def progress(items, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Progress(items, desc)
    return tqdm(list(items), desc=desc, unit="part")


def _group_of(key: str, layer_key: re.Pattern) -> tuple[int, int]:
    """Sort key: embedding first, layers in order, final norm and head last."""
    match = layer_key.match(key)
    if match:
        return (1, int(match.group(1)))
    return (0, 0) if "embed" in key else (2, 0)


def groups_by_layer(keys, layer_key: str) -> list[list[str]]:
    pattern = re.compile(layer_key)
    groups: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        groups.setdefault(_group_of(key, pattern), []).append(key)
    return [groups[g] for g in sorted(groups)]


# ---------------------------------------------------------------------------------------
# DCP -> Hugging Face
# ---------------------------------------------------------------------------------------


def load_dcp(checkpoint: str, keys: list[str], metadata) -> dict[str, torch.Tensor]:
    """Full tensors of `keys` from a DCP checkpoint, read by this process alone (no collectives,
    also inside a distributed job)."""
    tensors = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(tensors, checkpoint_id=checkpoint, no_dist=True)
    return tensors


def to_hf(checkpoint: str, out: str, args: Qwen3MoEArgs, dtype: torch.dtype = torch.bfloat16,
          drop_expert_bias: bool = False, shard_bytes: int = 5 * 2**30, show_progress: bool = True,
          held_out=None) -> BiasCost | None:
    """Export `checkpoint` to `out`. A non-zero expert bias is refused unless `drop_expert_bias`; then what
    dropping it costs is measured first on `held_out()` (batches of held-out tokens) and returned."""
    if not os.path.isfile(os.path.join(checkpoint, ".metadata")):
        raise ConvertError(f"{checkpoint}: not a complete DCP checkpoint (no .metadata)")
    metadata = read_dcp_metadata(checkpoint)
    check_data_files(checkpoint, metadata)
    check_checksums(checkpoint, warn_if_absent=False)  # its own lines are the export's
    shapes = model_shapes(metadata)
    mismatch = shape_mismatch(shapes, args)
    if mismatch:
        raise ConvertError(f"{checkpoint} does not fit the model settings given: {mismatch}")
    check_exportable(args)
    cost = None
    if check_expert_bias(checkpoint, metadata, drop_expert_bias) > 0:
        if held_out is None:
            raise ConvertError(NEED_HELD_OUT)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cost = measure_bias_cost(args, lambda keys: load_dcp(checkpoint, keys, metadata), held_out(), device)

    adapter = Qwen3MoEStateDictAdapter(args)
    groups = groups_by_layer(shapes, r"layers\.(\d+)\.")
    # Shard plan from shapes alone (meta tensors), so shards are written as soon as they fill.
    planned = []  # (hf key, bytes) in file order
    for keys in groups:
        meta = {k: torch.empty(shapes[k], dtype=dtype, device="meta") for k in keys}
        planned += [(k, t.numel() * t.element_size()) for k, t in adapter.to_hf(meta).items()]
    shard_of, shards, size = {}, [[]], 0
    for key, nbytes in planned:
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        shard_of[key] = len(shards) - 1
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    pending: list[dict[str, torch.Tensor]] = [{} for _ in shards]
    items = progress(groups, f"{os.path.basename(checkpoint.rstrip('/'))} -> {out}") if show_progress else groups
    for keys in items:
        for hf_key, tensor in adapter.to_hf(load_dcp(checkpoint, keys, metadata)).items():
            index = shard_of[hf_key]
            pending[index][hf_key] = tensor.to(dtype).contiguous()
            if len(pending[index]) == len(shards[index]):
                save_file(pending[index], os.path.join(out, names[index]), metadata={"format": "pt"})
                pending[index] = {}
    if len(shards) > 1:
        total = sum(nbytes for _, nbytes in planned)
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[shard_of[k]] for k, _ in planned}}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(args, dtype), f, indent=2)
    return cost


def check_expert_bias(checkpoint: str, metadata, drop: bool) -> float:
    """The largest |expert bias| of the checkpoint; a non-zero one is refused unless `drop`."""
    keys = [k for k in metadata.state_dict_metadata if k.endswith("moe.router.expert_bias")]
    if not keys:
        return 0.0
    biases = load_dcp(checkpoint, keys, metadata)
    worst_key = max(keys, key=lambda k: float(biases[k].abs().max()))
    worst = float(biases[worst_key].abs().max())
    if worst > 0 and not drop:
        raise ConvertError(
            f"{worst_key} is not zero (max |bias| {worst:.3g}): Hugging Face Qwen3-MoE has no expert bias, so the "
            "export would pick other experts than the trained model does; pass --drop-expert-bias to export anyway "
            "(it first prints what that costs)")
    return worst


def held_out_batches(opts, job_config, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out tokens --drop-expert-bias measures on: --eval-tokens, else the --config run's stream."""
    if opts.eval_tokens:
        try:
            return token_file_batches(opts.eval_tokens, opts.eval_batches, vocab_size)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConvertError(f"--eval-tokens {opts.eval_tokens}: {e}") from None
    if job_config is None:
        raise ConvertError(NEED_HELD_OUT)
    if job_config.training.dataset != "synthetic":
        raise ConvertError(f"--config {opts.config}: [training] dataset = {job_config.training.dataset!r} is what "
                           "the run trained on, not held out: pass --eval-tokens FILE (held-out token ids "
                           "[sequences, length + 1], saved with torch.save)")
    return synthetic_held_out(job_config, vocab_size, opts.eval_batches)


# ---------------------------------------------------------------------------------------
# Hugging Face -> DCP
# ---------------------------------------------------------------------------------------


def hf_files(folder: str) -> dict[str, str]:
    """Hugging Face key -> safetensors file, from the index or from the files themselves."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, ConvertError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{index_path}: no 'weight_map' table")
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConvertError(f"{folder}: no *.safetensors files")
    found = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            found.update({k: path for k in f.keys()})
    return found


def read_hf_args(folder: str) -> Qwen3MoEArgs:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{folder}: no config.json (a Hugging Face model folder has one)")
    return args_from_hf_config(read_json(path, ConvertError), path)


def load_hf(folder: str, args: Qwen3MoEArgs, dtype: torch.dtype | None = None,
            show_progress: bool = True) -> dict[str, torch.Tensor]:
    """Our full state dict (expert_bias zero) from a Hugging Face Qwen3-MoE folder."""
    from safetensors import safe_open

    files = hf_files(folder)
    adapter = Qwen3MoEStateDictAdapter(args)
    state_dict: dict[str, torch.Tensor] = {}
    groups = groups_by_layer(files, r"model\.layers\.(\d+)\.")
    for keys in progress(groups, f"{folder} -> DCP") if show_progress else groups:
        part = {}
        for path in sorted({files[k] for k in keys}):
            with safe_open(path, framework="pt") as f:
                part.update({k: f.get_tensor(k) for k in keys if files[k] == path})
        if dtype is not None:
            part = {k: v.to(dtype) for k, v in part.items()}
        state_dict.update(adapter.from_hf(part))
    for layer in range(args.n_layers):  # the bias that Hugging Face lacks: zero picks as it does
        state_dict[f"layers.{layer}.moe.router.expert_bias"] = torch.zeros(args.moe.num_experts)
    mismatch = shape_mismatch({k: tuple(v.shape) for k, v in state_dict.items()}, args)
    if mismatch:
        raise ConvertError(f"{folder}: the weights do not fit its config.json: {mismatch}")
    return state_dict


def from_hf(folder: str, out: str, dtype: torch.dtype | None = None, show_progress: bool = True) -> Qwen3MoEArgs:
    args = read_hf_args(folder)
    check_safetensors(folder, ConvertError)
    state_dict = load_hf(folder, args, dtype, show_progress)
    dcp.save(state_dict, storage_writer=ChecksummedWriter(out), no_dist=True)  # with its checksums.json
    write_model_args(out, args)
    return args


def start_hint(args: Qwen3MoEArgs, out: str) -> str:
    """How to start a run from a converted checkpoint, with the flavor and [moe] keys it needs."""
    flavor = matching_flavor(args)
    if flavor is None:
        return (f"no shipped flavor has this architecture (dim {args.dim}, {args.n_layers} layers, "
                f"{args.n_heads} heads): add one to torchtitan_moe/models/qwen3_moe/args.py")
    base = FLAVORS[flavor].moe
    extra = "".join(f" --moe.{name} {getattr(args.moe, name)}" for name in ("num_experts", "top_k", "inter_dim")
                    if getattr(args.moe, name) != getattr(base, name))
    if args.moe.router.route_norm != base.router.route_norm:
        extra += f" --router.route_norm {args.moe.router.route_norm}"
    return f"start a run from it: --model.flavor {flavor}{extra} --checkpoint.initial_load_path {out}"


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def run_config(opts):
    """The --config run's job config (None without --config), checked as `check_config` does without a
    process count; read only, so unlike training's set-up it leaves this process's environment alone."""
    if not opts.config:
        return None
    from torchtitan_moe.train.job_config import load_job_config

    return load_job_config(["--job.config_file", opts.config])


def resolve_args(checkpoint: str, opts, job_config=None) -> Qwen3MoEArgs:
    """The model settings of a DCP checkpoint: --flavor, else its model_args.json (what the run trained),
    else --config (`job_config`; with model_args.json, --config only names the held-out data)."""
    saved = read_model_args(checkpoint)
    if opts.flavor:
        if opts.flavor not in FLAVORS:
            raise ConvertError(f"--flavor {opts.flavor}: expected one of {', '.join(FLAVORS)}")
        args = flavor_args(opts.flavor)
    elif saved is not None:
        args = saved
    elif job_config is not None:
        args = flavor_args(job_config.model.flavor)
        args.update_from_config(job_config)
    else:
        raise ConvertError(f"{checkpoint} has no model_args.json: pass --config RUN.toml (the run's config) "
                           "or --flavor NAME with the run's --num-experts/--top-k/--inter-dim")
    overrides = {k: v for k, v in (("num_experts", opts.num_experts), ("top_k", opts.top_k),
                                   ("inter_dim", opts.inter_dim)) if v is not None}
    if overrides:
        args.moe = dataclasses.replace(args.moe, **overrides)
    return args


class _Parser(argparse.ArgumentParser):
    """argparse, whose refusal of an argument is one line (not the usage and the error)."""

    def error(self, message: str):
        print(f"convert: error: {message} (--help lists the arguments)", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str] | None):
    parser = _Parser(prog="python -m torchtitan_moe.hf.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    out = sub.add_parser("to-hf", help="DCP step folder -> Hugging Face folder")
    out.add_argument("checkpoint", help="a step folder, e.g. outputs/run/checkpoint/step-1000")
    out.add_argument("out", help="the Hugging Face folder to write")
    out.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    out.add_argument("--config", help="the run's TOML: its model settings when the step folder has no model_args.json, "
                                      "its synthetic stream for --drop-expert-bias")
    out.add_argument("--flavor", help="the run's flavor (when the step folder has no model_args.json)")
    out.add_argument("--num-experts", type=int)
    out.add_argument("--top-k", type=int)
    out.add_argument("--inter-dim", type=int)
    out.add_argument("--drop-expert-bias", action="store_true",
                     help="export although the routers' expert bias is not zero (routing will differ); first "
                          "prints the held-out loss with and without it and the share of tokens whose experts change")
    out.add_argument("--eval-tokens", help="held-out token ids for --drop-expert-bias: an int tensor [sequences, "
                                           "length + 1] saved with torch.save (default: the --config run's stream)")
    out.add_argument("--eval-batches", type=int,
                     help="batches of held-out tokens --drop-expert-bias measures on (the run's batch shape, or "
                          "8 sequences of --eval-tokens each; default 8)")
    out.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    into = sub.add_parser("from-hf", help="Hugging Face folder -> model-only DCP checkpoint")
    into.add_argument("hf_folder")
    into.add_argument("out", help="the DCP checkpoint folder to write")
    into.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    for sub_parser in (out, into):
        sub_parser.add_argument("--force", action="store_true", help="write into an output folder that is not empty")
    return parser.parse_args(argv)


def check_output_folder(out: str, force: bool) -> None:
    """Refuse to write among files already there (an earlier export, a checkpoint) unless told to."""
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ConvertError(f"{out} is not empty: choose a new output folder, or pass --force to write into it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConvertError(f"{out} is a file: the output must be a folder")


def check_arguments(opts) -> None:
    """What the arguments must be before anything is read or written."""
    source = opts.checkpoint if opts.direction == "to-hf" else opts.hf_folder
    if not os.path.isdir(source):
        what = "a step folder of a run" if opts.direction == "to-hf" else "a Hugging Face model folder"
        raise ConvertError(f"{source}: no such folder ({what})")
    if opts.direction != "to-hf":
        return
    if not os.path.isfile(os.path.join(source, ".metadata")):
        raise ConvertError(f"{source}: not a complete DCP checkpoint (no .metadata)")
    if not opts.shard_gb > 0:
        raise ConvertError(f"--shard-gb {opts.shard_gb}: must be > 0 (the largest safetensors file, GiB)")
    for flag in ("num_experts", "top_k", "inter_dim"):
        value = getattr(opts, flag)
        if value is not None and value < 1:
            raise ConvertError(f"--{flag.replace('_', '-')} {value}: must be >= 1")


@contextlib.contextmanager
def writing(out: str):
    """Write into `out`; on any failure remove what was written (the folder itself if it was made here)."""
    existed = set(os.listdir(out)) if os.path.isdir(out) else None
    try:
        yield
    except BaseException as e:
        if existed is None:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for name in set(os.listdir(out)) - existed:
                path = os.path.join(out, name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        if isinstance(e, OSError):
            raise ConvertError(f"writing {out} failed ({type(e).__name__}: {e}); what was written is removed") from None
        raise


def check_eval_options(opts) -> None:
    if (opts.eval_tokens or opts.eval_batches is not None) and not opts.drop_expert_bias:
        raise ConvertError("--eval-tokens and --eval-batches pick the held-out tokens --drop-expert-bias measures "
                           "on: pass them with --drop-expert-bias")
    if opts.eval_batches is not None and opts.eval_batches < 1:
        raise ConvertError(f"--eval-batches {opts.eval_batches}: must be >= 1")
    opts.eval_batches = opts.eval_batches or EVAL_BATCHES


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        check_arguments(opts)
        check_output_folder(opts.out, opts.force)
        if opts.direction == "to-hf":
            check_eval_options(opts)
            job_config = run_config(opts)
            args = resolve_args(opts.checkpoint, opts, job_config)
            with writing(opts.out):
                cost = to_hf(opts.checkpoint, opts.out, args, DTYPES[opts.dtype], opts.drop_expert_bias,
                             int(opts.shard_gb * 2**30),
                             held_out=lambda: held_out_batches(opts, job_config, args.vocab_size))
            if cost is not None:
                print(cost.describe())
            elif opts.drop_expert_bias:
                print("the expert bias is zero in every layer: the export routes as the trained model does")
            print(f"wrote {opts.out}: transformers.AutoModelForCausalLM.from_pretrained({opts.out!r})")
        else:
            with writing(opts.out):
                args = from_hf(opts.hf_folder, opts.out, DTYPES[opts.dtype] if opts.dtype else None)
            print(f"wrote {opts.out}; {start_hint(args, opts.out)}")
    except (ConvertError, HFConversionError, ConfigError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
