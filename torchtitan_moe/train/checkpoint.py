"""What a run is about to load, checked before it loads: resume, change parallelism, start from weights.

torchtitan's CheckpointManager, at the start of train(), loads
  - the newest *complete* step folder of <job.dump_folder>/<checkpoint.folder> (or
    `checkpoint.load_step`): model, optimizer, lr schedule, step and data position.
    A step folder is complete once DCP has written its `.metadata`, which it writes last, so a
    run killed while saving leaves an incomplete folder and resumes from the one before;
  - else `checkpoint.initial_load_path` (weights only by default; a Hugging Face folder with
    `checkpoint.initial_load_in_hf`).
Every tensor is saved with its global shape, so DCP reshards model and optimizer to any FSDP/EP
layout on load. The data position is per data-parallel rank: it is refused below when their
number changed (`--checkpoint.exclude_from_loading dataloader` restarts the data instead).

`check_checkpoint_to_load` refuses, in one line that says what to do, what would otherwise fail
deep inside DCP or train wrong: a model-only checkpoint resumed as a full one, a checkpoint of
another architecture (flavor, experts, inter_dim, ...), a data position of another DP degree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import args_from_hf_config, arch_differences, hf_config
from torchtitan_moe.moe.options import MoEArgs, RouterOptions
from torchtitan_moe.compat.torchtitan import logger

TRAINING_STATE_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
_STEP_FOLDER = re.compile(r"step-(\d+)")
_DP_RANK_KEY = re.compile(r"dataloader\.dp_rank_(\d+)")


class CheckpointError(ConfigError):
    """The checkpoint a run would load does not fit it (one line: what differs, what to do)."""


@dataclass
class PlannedLoad:
    """What torchtitan's CheckpointManager.load() will read, decided the way it decides."""

    path: str
    step: int | None  # None for an initial load (initial_load_path / hf_assets_path)
    model_only: bool
    from_hf: bool


def is_complete(step_folder: str) -> bool:
    """torchtitan's test: DCP's .metadata, or the index of a Hugging Face export."""
    return os.path.isfile(os.path.join(step_folder, ".metadata")) or is_hf_folder(step_folder)


def is_hf_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))


def step_folders(folder: str) -> dict[int, str]:
    """step -> path of every step-N folder, complete or not."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in os.listdir(folder):
        match = _STEP_FOLDER.fullmatch(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found[int(match.group(1))] = os.path.join(folder, name)
    return found


def planned_load(checkpoint_config, dump_folder: str, hf_assets_path: str | None = None) -> PlannedLoad | None:
    """Mirror of the choice in torchtitan 0.2.2's CheckpointManager.load(); None: nothing loads."""
    ck = checkpoint_config
    if not ck.enable:
        return None
    folder = os.path.join(dump_folder, ck.folder)
    if os.path.exists(folder):
        steps = step_folders(folder)
        step = ck.load_step
        if step == -1:
            complete = [s for s, path in steps.items() if is_complete(path)]
            for s in sorted(s for s in steps if s not in complete and s > max(complete, default=-1)):
                logger.warning(f"{steps[s]} is incomplete (no .metadata: the run stopped while saving it); skipping it")
            if not complete:
                return None
            step = max(complete)
        elif step in steps and not is_complete(steps[step]):
            raise CheckpointError(f"--checkpoint.load_step {step}: {steps[step]} is incomplete (no .metadata: the "
                                  "run stopped while saving it); pick a complete step")
        return PlannedLoad(os.path.join(folder, f"step-{step}"), step, model_only=step == 0, from_hf=False)
    if ck.initial_load_path:
        return PlannedLoad(ck.initial_load_path, None, ck.initial_load_model_only, ck.initial_load_in_hf)
    if ck.initial_load_in_hf and hf_assets_path:
        return PlannedLoad(hf_assets_path, None, True, True)
    return None


def read_dcp_metadata(path: str):
    """The DCP metadata of a step folder; one line if it cannot be read (the folder is left as it is)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # truncated or corrupt pickle: UnpicklingError, EOFError, ValueError, ...
        raise CheckpointError(f"{path}: its .metadata cannot be read ({type(e).__name__}: {e}); nothing was "
                              f"changed on disk; {_resume_hint(path)}") from None


def check_data_files(path: str, metadata) -> None:
    """Every .distcp file the metadata points into exists and is long enough (a copy or save cut
    short leaves one truncated, which DCP reports only as an EOFError deep inside the load)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            what = "is missing" if size is None else f"is truncated ({size:,} of at least {end:,} bytes)"
            raise CheckpointError(f"{file} {what}; nothing was changed on disk; {_resume_hint(path)}")


def check_checksums(path: str, split_over_ranks: bool = False, warn_if_absent: bool = True) -> None:
    """The step's data files against the checksums.json written with them (train/checksums.py); one line
    naming the first bad file and the newest good step. `split_over_ranks`: every rank of the initialized
    process group calls this, and each hashes its share of the chunks. A step saved without checksums is
    let through, with a warning unless `warn_if_absent` is false."""
    import torch.distributed as dist

    from torchtitan_moe.train.checksums import CHECKSUMS_FILE, checksum_problem, read_manifest

    rank, world = (dist.get_rank(), dist.get_world_size()) if split_over_ranks else (0, 1)
    try:
        if read_manifest(path) is None:
            if warn_if_absent:
                logger.warning(f"{path} has no {CHECKSUMS_FILE} (saved before checksums were written): not verified")
            return
        problem = checksum_problem(path, rank, world)
    except ValueError as e:
        problem = str(e)
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(f"{problem}; nothing was changed on disk; {_resume_hint(path)}")


def _resume_hint(step_path: str) -> str:
    """How to go on from a step folder that cannot be read: the newest readable full step before it."""
    match = _STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(step_path)))
    if not match:
        return "point --checkpoint.initial_load_path at a readable checkpoint"
    earlier = _newest_full_step_before(os.path.dirname(os.path.normpath(step_path)), int(match.group(1)))
    if earlier is None:
        return "no earlier full step to resume from: start over in a new --job.dump_folder"
    return f"resume from step {earlier} with --checkpoint.load_step {earlier}"


def model_shapes(metadata) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model's tensors in a DCP checkpoint (training state left out)."""
    return {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if not key.startswith(TRAINING_STATE_PREFIXES) and hasattr(md, "size")}


def expected_shapes(args: Qwen3MoEArgs) -> dict[str, tuple[int, ...]]:
    """The saved tensors' shapes of a qwen3_moe model with `args` (built on the meta device)."""
    from torchtitan_moe.models.qwen3_moe.model import Qwen3MoEModel

    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    return {key: tuple(t.shape) for key, t in model.state_dict().items()}


def describe_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The architecture numbers a state dict's shapes imply (what a mismatch message names)."""
    layers = {int(m.group(1)) for key in shapes if (m := re.match(r"layers\.(\d+)\.", key))}
    out = {"n_layers": len(layers)}
    if "tok_embeddings.weight" in shapes:
        out["vocab_size"], out["dim"] = shapes["tok_embeddings.weight"]
    if "layers.0.moe.experts.w2" in shapes:
        out["num_experts"], _, out["inter_dim"] = shapes["layers.0.moe.experts.w2"]
    head_dim = shapes.get("layers.0.attention.q_norm.weight", (None,))[0]
    if head_dim:
        out["head_dim"] = head_dim
        out["n_heads"] = shapes["layers.0.attention.wq.weight"][0] // head_dim
        out["n_kv_heads"] = shapes["layers.0.attention.wk.weight"][0] // head_dim
    return out


def describe_args(args: Qwen3MoEArgs) -> dict[str, int]:
    """What describe_shapes finds in a checkpoint of a model with `args`."""
    return {"n_layers": args.n_layers, "vocab_size": args.vocab_size, "dim": args.dim,
            "num_experts": args.moe.num_experts, "inter_dim": args.moe.inter_dim, "head_dim": args.head_dim,
            "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads}


_SETTING = {"num_experts": "[moe] num_experts", "inter_dim": "[moe] inter_dim"}


def shape_mismatch(saved: dict[str, tuple[int, ...]], args: Qwen3MoEArgs) -> str | None:
    """None when `saved` fits a model with `args`, else what differs, in the words of the config."""
    have, want = describe_shapes(saved), describe_args(args)
    differ = [name for name in want if name in have and have[name] != want[name]]
    if differ:
        keys = sorted({_SETTING.get(name, "[model] flavor") for name in differ})
        flavor = next((name for name, flavor_args in FLAVORS.items()
                       if all(describe_args(flavor_args)[k] == v for k, v in have.items() if k not in _SETTING)), None)
        hint = f" (flavor '{flavor}' has its shapes)" if flavor and "[model] flavor" in keys else ""
        diffs = ", ".join(f"{name} {have[name]} vs {want[name]}" for name in differ)
        return f"{diffs} (checkpoint vs this run); set {' and '.join(keys)} as the checkpoint's run had them{hint}"
    expected = expected_shapes(args)
    for key, shape in expected.items():
        if key not in saved:
            return f"{key} is missing from the checkpoint"
        if saved[key] != shape:
            return f"{key} has shape {saved[key]} in the checkpoint vs {shape} in this run"
    return None


def check_checkpoint_to_load(job_config, model_args: Qwen3MoEArgs, dp_degree: int | None,
                             split_over_ranks: bool = False) -> PlannedLoad | None:
    """Refuse (CheckpointError, one line) a checkpoint that cannot resume or start this run. `dp_degree`: the
    run's data-parallel ranks (None: unknown, not checked); `split_over_ranks`: called by every rank of the run,
    which share the hashing of its checksums."""
    plan = planned_load(job_config.checkpoint, job_config.job.dump_folder, job_config.model.hf_assets_path)
    if plan is None:
        return None
    if not os.path.isdir(plan.path):
        flag = "initial_load_path" if plan.step is None else f"load_step {plan.step}"
        raise CheckpointError(f"--checkpoint.{flag}: {plan.path} does not exist")
    if plan.from_hf:
        _check_hf(plan, model_args)
        return plan
    if is_hf_folder(plan.path) and not os.path.isfile(os.path.join(plan.path, ".metadata")):
        raise CheckpointError(
            f"{plan.path} is a Hugging Face export (weights only): it cannot resume training; start a new run "
            f"from it with --checkpoint.initial_load_path {plan.path} --checkpoint.initial_load_in_hf "
            "(in a new --job.dump_folder)")
    metadata = read_dcp_metadata(plan.path)
    check_data_files(plan.path, metadata)
    check_checksums(plan.path, split_over_ranks)
    keys = metadata.state_dict_metadata
    mismatch = shape_mismatch(model_shapes(metadata), model_args)
    if mismatch:
        raise CheckpointError(f"{plan.path} does not fit this run: {mismatch}")
    saved_args = read_model_args(plan.path)
    differences = arch_differences(saved_args, model_args) if saved_args else []
    if differences:
        logger.warning(f"{plan.path} was saved by a run with {'; '.join(differences)} (checkpoint vs this run)")
    if plan.model_only:
        return plan
    if "train_state.step" not in keys:
        earlier = _newest_full_step_before(os.path.dirname(plan.path), plan.step)
        also = f", or resume from step {earlier} (--checkpoint.load_step {earlier})" if earlier is not None else ""
        raise CheckpointError(
            f"{plan.path} holds the model only (no optimizer, step or data position), so it cannot resume "
            f"training; start a new run from its weights with --checkpoint.initial_load_path {plan.path} "
            f"(in a new --job.dump_folder){also}")
    excluded = set(job_config.checkpoint.exclude_from_loading)
    saved_dp = len([k for k in keys if _DP_RANK_KEY.fullmatch(k)])
    if "dataloader" not in excluded and saved_dp and dp_degree is not None and saved_dp != dp_degree:
        raise CheckpointError(
            f"{plan.path} holds the data positions of {saved_dp} data-parallel ranks and this run has {dp_degree}: "
            "they cannot be carried over; add --checkpoint.exclude_from_loading dataloader to resume model, "
            "optimizer and step with every rank's data stream restarted from its beginning")
    return plan


def _newest_full_step_before(folder: str, step: int | None) -> int | None:
    """The newest complete full checkpoint before `step`, if any."""
    for s in sorted(step_folders(folder), reverse=True):
        path = os.path.join(folder, f"step-{s}")
        if (step is None or s < step) and s > 0 and os.path.isfile(os.path.join(path, ".metadata")):
            try:
                metadata = read_dcp_metadata(path)
                check_data_files(path, metadata)
                check_checksums(path, warn_if_absent=False)
            except CheckpointError:
                continue  # unreadable too: look further back
            if "train_state.step" in metadata.state_dict_metadata:
                return s
    return None


def _check_hf(plan: PlannedLoad, model_args: Qwen3MoEArgs) -> None:
    config_path = os.path.join(plan.path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{plan.path}: no config.json (a Hugging Face Qwen3-MoE folder has one)")
    hf_args = args_from_hf_config(read_json(config_path, CheckpointError), config_path)
    check_safetensors(plan.path, CheckpointError)
    mismatch = shape_mismatch(expected_shapes(hf_args), model_args)
    if mismatch:
        raise CheckpointError(f"{plan.path} does not fit this run: {mismatch}")
    shapes = describe_args(hf_args)
    other = [d for d in arch_differences(hf_args, model_args) if d.split(":")[0] not in shapes]
    if other:
        logger.warning(f"{plan.path}: the Hugging Face model differs from this run in {'; '.join(other)} "
                       "(Hugging Face vs this run): its weights are loaded as they are")


@contextlib.contextmanager
def saving(folder: str, step: int):
    """A save of `step` into `folder` that fails while writing (a full disk, a lost mount) raises one line:
    the first rank's error, and the space left on the disk. The step folder it leaves has no .metadata
    (DCP writes it last), so a resume skips it."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        yield
    except (Exception, CheckpointException) as e:
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        cause = e
        if isinstance(failures, dict) and failures:
            first = failures[min(failures)]
            cause = first[0] if isinstance(first, tuple) else first
        if not isinstance(cause, (OSError, RuntimeError)):
            raise
        reason = " ".join(str(cause).split())[:300]
        try:
            free = f"{shutil.disk_usage(folder).free / 2**30:,.2f} GiB free on its disk"
        except OSError:
            free = "its disk cannot be read"
        raise CheckpointError(f"saving step {step} into {folder} failed ({type(cause).__name__}: {reason}); "
                              f"{free}; the step folder left has no .metadata, so a resume skips it") from None


def read_json(path: str, error: type[Exception]) -> dict:
    """A JSON object from `path`, or `error` in one line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def check_safetensors(folder: str, error: type[Exception]) -> None:
    """Every *.safetensors file of a Hugging Face folder has a readable header and all the bytes it announces
    (a copy cut short fails here, in one line naming the file, instead of deep inside the load)."""
    import glob

    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise error(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); nothing was "
                        "changed on disk") from None


# ---------------------------------------------------------------------------------------
# model_args.json: the model a step folder holds, for conversion and for resume warnings.
# ---------------------------------------------------------------------------------------

MODEL_ARGS_FILE = "model_args.json"


def write_model_args(folder: str, args: Qwen3MoEArgs) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, MODEL_ARGS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
    os.replace(tmp, os.path.join(folder, MODEL_ARGS_FILE))


def read_model_args(folder: str) -> Qwen3MoEArgs | None:
    """The args recorded in a step folder, or None (a folder saved without them)."""
    path = os.path.join(folder, MODEL_ARGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        moe = saved.pop("moe", {})
        args = Qwen3MoEArgs(**_known(Qwen3MoEArgs, saved))
        args.moe = _moe_args(moe)
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not a table of the model's args
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); nothing was changed on disk; "
                              f"{_resume_hint(folder)}") from None
    return args


def _known(cls: type, saved: dict) -> dict:
    """The keys of `saved` that `cls` has (a file of another version may hold others; missing ones default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in saved.items() if k in names}


def _moe_args(saved: dict) -> MoEArgs:
    """MoEArgs of model_args.json's "moe" table. Files written before the router had its own settings hold
    them flat in that table, the gate's init std as router_init_std and its dtype as router_gate_dtype."""
    saved = dict(saved)
    router = saved.pop("router", None)
    if router is None:  # the flat layout
        router = {k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(RouterOptions)}}
        if "router_init_std" in saved:
            router["init_std"] = saved["router_init_std"]
        gate_dtype = saved.get("router_gate_dtype", "float32")
        router["gate_precision"] = "float32" if gate_dtype == "float32" else "param"
        if gate_dtype != "float32":
            saved["param_dtype"] = gate_dtype
    return MoEArgs(**{**_known(MoEArgs, saved), "router": RouterOptions(**_known(RouterOptions, router))})


def record_model_args(checkpointer, model_args: Qwen3MoEArgs, export_dtype: torch.dtype) -> None:
    """After each save, rank 0 writes the model's args into the step folder (model_args.json),
    and the config.json that makes a last_save_in_hf export a Hugging Face model folder."""
    save = checkpointer.save

    def save_and_record(curr_step: int, last_step: bool = False) -> None:
        save(curr_step, last_step)
        folder = os.path.join(checkpointer.folder, f"step-{curr_step}")
        # The folder exists once a save (sync, or the planning of an async one) has begun.
        if (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0) or not os.path.isdir(folder):
            return
        write_model_args(folder, model_args)
        if any(name.endswith(".safetensors") for name in os.listdir(folder)):
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(hf_config(model_args, export_dtype), f, indent=2)

    checkpointer.save = save_and_record
