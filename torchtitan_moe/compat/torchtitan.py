"""The one adapter between torchtitan-moe and torchtitan (pinned to 0.2.2).

Every torchtitan import of the package goes through this module, so a move to a newer
torchtitan changes this file (and nothing else) first. The second half is the CPU/gloo
shim that lets torchtitan's Trainer run on machines without a GPU.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import warnings
from types import SimpleNamespace

import torch
import tyro

import torchtitan
from torchtitan.components.dataloader import BaseDataLoader, DataloaderExhaustedError, ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TorchtitanJobConfig
from torchtitan.config.manager import custom_registry
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.attention import FlexAttentionWrapper, create_attention_mask, get_causal_mask_mod
from torchtitan.models.moe import MoE as TorchtitanMoE
from torchtitan.models.moe import MoEArgs as TorchtitanMoEArgs
from torchtitan.models.qwen3 import Qwen3Model as TorchtitanQwen3Model
from torchtitan.models.qwen3 import Qwen3ModelArgs as TorchtitanQwen3ModelArgs
from torchtitan.models.qwen3 import parallelize_qwen3 as torchtitan_parallelize_qwen3
from torchtitan.models.qwen3.model.model import Attention, precompute_rope_cache
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools import utils as tt_utils
from torchtitan.tools.logging import init_logger as _torchtitan_init_logger
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

TORCHTITAN_VERSION = "0.2.2"
CUSTOM_CONFIG_MODULE = "torchtitan_moe.config.sections"

__all__ = [
    "Attention",
    "BaseDataLoader",
    "BaseModelArgs",
    "BaseTokenizer",
    "ConfigParser",
    "DataloaderExhaustedError",
    "FlexAttentionWrapper",
    "IGNORE_INDEX",
    "MetricsProcessor",
    "ModelProtocol",
    "OptimizersContainer",
    "ParallelAwareDataloader",
    "ParallelDims",
    "StateDictAdapter",
    "TrainSpec",
    "Trainer",
    "TorchtitanJobConfig",
    "TorchtitanMoE",
    "TorchtitanMoEArgs",
    "TorchtitanQwen3Model",
    "TorchtitanQwen3ModelArgs",
    "apply_ac",
    "build_cross_entropy_loss",
    "build_lr_schedulers",
    "build_optimizers",
    "check_torchtitan_version",
    "create_attention_mask",
    "data_parallel_mesh",
    "dist_utils",
    "enable_cpu_training",
    "exit_process",
    "get_causal_mask_mod",
    "get_train_spec",
    "init_logger",
    "logger",
    "merged_config_class",
    "precompute_rope_cache",
    "register_train_spec",
    "replace_clip_grad_norm",
    "route_checkpoint_saves",
    "torchtitan_parallelize_qwen3",
    "trunc_normal_",
    "use_sum_reductions",
]


# torchtitan's own gradient clipping, kept before replace_clip_grad_norm swaps it out.
_TORCHTITAN_CLIP_GRAD_NORM = dist_utils.clip_grad_norm_


def replace_clip_grad_norm(make_clip) -> None:
    """Trainer.train_step clips through `dist_utils.clip_grad_norm_`, looked up at each step:
    make_clip(torchtitan's function) -> the function the steps call from now on, with its signature
    (optimizer.clip_in_optimizer: the clipping applied inside the optimizer's update)."""
    dist_utils.clip_grad_norm_ = make_clip(_TORCHTITAN_CLIP_GRAD_NORM)


class _DcpWithWriter:
    """torch.distributed.checkpoint as torchtitan's checkpoint module sees it: a save given no storage
    writer of its own writes through make_writer(checkpoint_id)."""

    def __init__(self, dcp, make_writer):
        self.dcp, self.make_writer = dcp, make_writer

    def save(self, state_dict, *, checkpoint_id=None, storage_writer=None, **kwargs):
        if storage_writer is None and checkpoint_id is not None:
            storage_writer = self.make_writer(str(checkpoint_id))
        return self.dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs)

    def async_save(self, state_dict, *, checkpoint_id=None, storage_writer=None, **kwargs):
        if storage_writer is None and checkpoint_id is not None:
            storage_writer = self.make_writer(str(checkpoint_id))
        return self.dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs)

    def __getattr__(self, name):
        return getattr(self.dcp, name)


def route_checkpoint_saves(make_writer) -> None:
    """torchtitan's CheckpointManager saves with `dcp.save` / `dcp.async_save`: from now on every such save
    without a writer of its own (all but the Hugging Face export) writes through make_writer(checkpoint_id)."""
    import torchtitan.components.checkpoint as checkpoint_module

    dcp = checkpoint_module.dcp
    checkpoint_module.dcp = _DcpWithWriter(getattr(dcp, "dcp", dcp), make_writer)


def check_torchtitan_version() -> None:
    found = getattr(torchtitan, "__version__", "unknown")
    if found != TORCHTITAN_VERSION:
        raise RuntimeError(
            f"torchtitan-moe needs torchtitan=={TORCHTITAN_VERSION}, found {found}: "
            f"pip install torchtitan=={TORCHTITAN_VERSION}"
        )


class ConfigParser(ConfigManager):
    """torchtitan's ConfigManager, whose parse skips tyro's search of the config classes' source for comments
    to show as help (a tokenization of every class, ~0.15 s of each parse, paid by every rank and config
    check). torchtitan documents its fields in docstrings, which tyro still reads: --help is unchanged."""

    def parse_args(self, args: list[str]) -> TorchtitanJobConfig:
        toml_values = self._maybe_load_toml(args)
        config_cls = self._maybe_add_custom_config(args, toml_values)
        default = self._dict_to_dataclass(config_cls, toml_values) if toml_values else config_cls()
        self.config = tyro.cli(config_cls, args=args, default=default, registry=custom_registry,
                               config=(tyro.conf.HelptextFromCommentsOff,))
        self._validate_config()
        return self.config


def merged_config_class() -> type:
    """torchtitan's JobConfig with our sections merged in, as its ConfigManager builds it."""
    import importlib

    ours = importlib.import_module(CUSTOM_CONFIG_MODULE).JobConfig
    return ConfigManager._merge_configs(TorchtitanJobConfig, ours)


# ---------------------------------------------------------------------------------------
# CPU/gloo shim.
#
# torchtitan 0.2.2 picks "cuda" when no accelerator is found, then calls a CUDA-shaped
# device module (set_device, memory_stats, get_device_properties, ...). On a CPU machine we
# point it at `_CpuDeviceModule`, which answers those calls for the host: memory is the
# process's peak resident set size; its profiler traces the host alone. FSDP2's gradient
# reduce-scatter uses averaging ops that gloo lacks, so FSDP modules are told to reduce with
# plain sums (`use_sum_reductions`).
# ---------------------------------------------------------------------------------------

_PATCHED_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiling",
)


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _CpuDeviceModule:
    """The subset of `torch.cuda` that torchtitan's Trainer and metrics call, for the host."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass  # the peak RSS of a process cannot be reset: the step line shows the run's peak


# torchtitan's log lines that say nothing a user can act on: without `lspci` (containers) it
# falls back to the device name, which names the GPU; on a CPU there is no peak to measure
# MFU against (components/metrics.py then prints no MFU), so its A100 fallback and the peak it logs are
# wrong there.
# torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and torchtitan always takes it to 3 (its flight
# recorder needs that), warning about an override nobody asked for.
_NOISE = ("Error running lspci", "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3")
_CPU_NOISE = ("Peak flops undefined for: cpu", "Peak FLOPS used for computing MFU")
# Warnings of torch and torchdata that a CPU (gloo) run always triggers, each harmless here.
_CPU_WARNINGS = (
    "DTensor random operators may not have complete support on cpu device mesh",
    r"DTensor manual_seed\(\) may not have complete support on cpu device mesh",
    "'set_vital' is deprecated",
)


class _DropNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def init_logger() -> None:
    """torchtitan's logger, without its lines that are noise on this machine (see _NOISE)."""
    _torchtitan_init_logger()
    noise = _NOISE + (() if torch.cuda.is_available() else _CPU_NOISE)
    for handler in logger.handlers:
        handler.addFilter(_DropNoise(noise))


def enable_cpu_training() -> None:
    """Point torchtitan at the CPU (gloo) when there is no CUDA device. Idempotent."""
    if torch.cuda.is_available():
        return
    cpu_module = _CpuDeviceModule()
    for name in _PATCHED_MODULES:
        module = sys.modules.get(name) or __import__(name, fromlist=["_"])
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu_module
    # `set_pg_timeouts` passes device_ids to a barrier, which gloo rejects.
    dist_utils.set_pg_timeouts = _set_pg_timeouts_gloo
    # `[profiling]` passes [CPU, None] as the activities when there is no accelerator.
    sys.modules["torchtitan.tools.profiling"].torch = _TorchWithCpuProfiler()
    for message in _CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


class _TorchWithCpuProfiler:
    """`torch` as torchtitan.tools.profiling sees it on a CPU machine: its profiler traces the
    host alone (torch.profiler refuses the None that stands for the missing accelerator)."""

    class profiler:
        ProfilerActivity = torch.profiler.ProfilerActivity
        schedule = staticmethod(torch.profiler.schedule)

        @staticmethod
        def profile(*, activities, **kwargs):
            return torch.profiler.profile(activities=[a for a in activities if a is not None], **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def _set_pg_timeouts_gloo(timeout, parallel_dims) -> None:
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in groups + [None]:
        with warnings.catch_warnings():  # a group without a gloo backend keeps its timeout
            warnings.filterwarnings("ignore", message="Set timeout is now only supported", category=UserWarning)
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def use_sum_reductions(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce gradients with SUM (gloo has no AVG/PREMUL_SUM). No-op on NCCL."""
    from torch.distributed.fsdp import FSDPModule

    if torch.distributed.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def data_parallel_mesh(parallel_dims: ParallelDims):
    """The mesh FSDP2 shards and replicates the dense parameters over: ("dp_replicate", "fsdp")
    under HSDP, ("fsdp",) under FSDP. With replication only (fsdp of 1) torchtitan 0.2.2 hands out
    no "fsdp" mesh (it would use DDP); FSDP2 on its 2-D dense mesh is then DDP: a shard group of
    one process gathers and scatters nothing, and the gradients are summed over the replicas."""
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        return parallel_dims.get_mesh(names)
    parallel_dims.world_mesh  # builds the meshes
    return parallel_dims._global_meshes["dense"]["dp_replicate", "fsdp"]


def exit_process(code: int) -> None:
    """End a training process. Over gloo, skip the interpreter's teardown.

    Seen here about once in a few dozen 2-process CPU runs, always after training had finished,
    loggers were closed and every rank had left the process group: the C++ teardown of gloo
    groups still referenced from Python objects aborts ("terminate called without an active
    exception"), turning a good run into exit status -6. Everything is flushed first.
    """
    if torch.cuda.is_available():
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
