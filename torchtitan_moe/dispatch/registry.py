"""The dispatchers, each named once: what it takes, why a run cannot use it, how it is built.

    entry = get("all_gather")
    entry.problem(Run(ep=4))             -> "needs EP = 2 (every token goes to every EP rank), got 4"
    entry.machine_problem(group, run)    -> why this machine cannot run it (collective over the EP group), or None
    layer = entry.builder(run, group, device)   # refused (ValueError) where problem(run) is not None;
    dispatcher = layer(num_experts, align, kernels)  # makes what the layers share once, then one per layer

The config checks (config/sections.py), the choice and the build (parallel/choose.py, parallel/build.py)
and the tools (tune_dispatch, bench_train, plan) ask here. This package knows no config file: a problem
names the run's facts in the words it is given (`names`), plain ones below by default; the config layer
passes its keys ("[parallelism] expert_parallel_degree") and phrases the error. A new dispatcher is a
module of this package and an entry in DISPATCHERS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchtitan_moe.dispatch import deepep_backend
from torchtitan_moe.dispatch.all_gather import AllGatherDispatcher, build_transport
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.dispatch.deepep import DeepEPDispatcher
from torchtitan_moe.dispatch.peer_memory import peers_problem
from torchtitan_moe.dispatch.seam import BUFFERS, LocalDispatcher

OVERLAPS = ("none", "chunks")  # "chunks": one chunk's exchange under the other chunk's experts (moe/chunks.py)


@dataclass(frozen=True)
class Run:
    """A run as the dispatchers' rules read it: plain facts, no config keys."""

    ep: int  # expert-parallel degree
    overlap: str = "none"  # OVERLAPS
    buffers: str = "exact"  # BUFFERS (dispatch/seam.py)
    param_dtype: str = "bfloat16"  # the dtype the layers compute in (FSDP2 mixed precision)
    procs_per_node: int | None = None  # processes per node; None: not known here
    gpus: bool = False  # on CUDA devices (else CPU and gloo)
    hidden: int | None = None  # the layers' shapes, where known
    top_k: int | None = None
    experts: int | None = None


# How a problem names the run's facts unless told otherwise (config/sections.py names them by their keys).
PLAIN = {"ep": "EP", "overlap": "overlap", "buffers": "buffers", "param_dtype": "the parameters' dtype"}


def _allowed(values: tuple | None, quote: bool = False) -> str:
    """(2,) -> "= 2"; (2, 4, 8) -> "2, 4 or 8"; None -> "> 1" (EP sizes)."""
    if values is None:
        return "> 1"
    shown = [repr(v) if quote else str(v) for v in values]
    return f"= {shown[0]}" if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


@dataclass(frozen=True)
class Entry:
    name: str
    ep_sizes: tuple[int, ...] | None  # the EP degrees it takes; None: every degree above 1
    why_ep: str
    # (num_experts, align, kernels, run, group, shared) -> the layer's dispatcher
    build: Callable[..., Any]
    overlaps: tuple[str, ...] = OVERLAPS
    why_overlap: str = ""
    # The [dispatch] buffers it sizes what it receives by; () : it sizes nothing by them (either is
    # taken and changes nothing: it receives nothing, or always a fixed size).
    buffers: tuple[str, ...] = ()
    param_dtypes: tuple[str, ...] | None = None  # None: any
    why_dtype: str = ""
    one_node: str = ""  # why each EP group must sit inside one node; "": it need not
    tuned: bool = False  # takes DeepEP settings: the tuned table's, or [dispatch] num_sms
    # (group, device, settings, hidden) -> what the layers share (a buffer, a transport), made once
    shared: Callable[..., Any] | None = None
    missing: Callable[[], str | None] | None = None  # what this process lacks (a library), or None
    # (group, run) -> why this machine cannot run it for this run, or None. Collective over `group`.
    machine: Callable[..., str | None] | None = None

    def takes_ep(self, ep: int) -> bool:
        return ep in self.ep_sizes if self.ep_sizes is not None else ep > 1

    def problem(self, run: Run, names: dict[str, str] = PLAIN) -> str | None:
        """Why `run` cannot use this dispatcher, one phrase with the run's facts in `names`' words, or None."""
        if not self.takes_ep(run.ep):
            return f"needs {names['ep']} {_allowed(self.ep_sizes)} ({self.why_ep}), got {run.ep}"
        if run.overlap not in self.overlaps:
            return f"needs {names['overlap']} {_allowed(self.overlaps, quote=True)} ({self.why_overlap}), got {run.overlap!r}"
        if self.param_dtypes is not None and run.param_dtype not in self.param_dtypes:
            return (f"needs {names['param_dtype']} {_allowed(self.param_dtypes, quote=True)} ({self.why_dtype}), "
                    f"got {run.param_dtype!r}")
        if self.one_node and run.procs_per_node is not None and run.procs_per_node % run.ep:
            return (f"needs each EP group inside one node ({self.one_node}): at {names['ep']} = {run.ep} EP would "
                    f"span nodes ({run.procs_per_node} processes per node)")
        return None

    def machine_problem(self, group: dist.ProcessGroup | None, run: Run) -> str | None:
        """Why this machine cannot run it for `run` (a library, the EP group's nodes and peers, shapes
        its kernels do not take), or None. Collective over `group`: every rank gets the same answer."""
        return self.machine(group, run) if self.machine is not None else None

    def builder(self, run: Run, group: dist.ProcessGroup | None, device: torch.device, settings=None,
                hidden: int | None = None) -> Callable[[int, int, str], Any]:
        """Make what the layers share (DeepEP's buffer from `settings`, the all-gather's transport) and
        return layer(num_experts, align, kernels) -> that layer's dispatcher. A run this dispatcher does not
        take is refused here, before anything is made (ValueError in plain words)."""
        problem = self.problem(run)
        if problem:
            raise ValueError(f"{self.name} dispatcher: {problem}")
        shared = self.shared(group, device, settings, hidden) if self.shared is not None else None

        def layer(num_experts: int, align: int, kernels: str):
            return self.build(num_experts, align, kernels, run, group, shared)

        return layer


# -- each dispatcher's builders and machine checks ----------------------------------------------------


def _local(num_experts, align, kernels, run, group, shared):
    return LocalDispatcher(num_experts, align=align, kernels=kernels)


def _all_to_all(num_experts, align, kernels, run, group, shared):
    return AllToAllDispatcher(num_experts, group, align=align, kernels=kernels, buffers=run.buffers)


def _deepep_buffer(group, device, settings, hidden):
    settings = settings or deepep_backend.default_settings(dist.get_world_size(group))
    return deepep_backend.DeepEPV1(group, settings, hidden)


def _deepep(num_experts, align, kernels, run, group, shared):
    return DeepEPDispatcher(num_experts, shared, align=align, kernels=kernels, buffers=run.buffers)


def _deep_ep_missing() -> str | None:
    try:
        deepep_backend.import_deep_ep()
    except deepep_backend.DeepEPUnavailable as e:
        return str(e)
    return None


def _deepep_machine(group, run: Run) -> str | None:
    """The deep_ep library, shapes its kernels take (where known), the EP group on one node with peer access."""
    missing = _deep_ep_missing()
    if missing:
        return missing
    if run.hidden is not None:
        problem = deepep_backend.shape_problem(run.hidden, run.top_k, run.experts // run.ep)
        if problem:
            return problem
    try:
        deepep_backend.check_group(group)
    except deepep_backend.DeepEPUnavailable as e:
        return str(e)
    return None


def _all_gather(num_experts, align, kernels, run, group, shared):
    return AllGatherDispatcher(num_experts, shared, align=align, kernels=kernels)


def _all_gather_machine(group, run: Run) -> str | None:
    """On GPUs the copy-engine transport maps the other rank's memory: one node, peer access."""
    return peers_problem(group) if run.gpus and group is not None else None


DISPATCHERS: dict[str, Entry] = {e.name: e for e in [
    Entry("local", (1,), "every expert on this rank: nothing travels", _local,
          overlaps=("none",), why_overlap="nothing travels to overlap"),
    Entry("all_to_all", None, "it exchanges tokens between EP ranks", _all_to_all, buffers=BUFFERS),
    Entry("deepep", deepep_backend.EP_SIZES, "DeepEP's intranode kernels", _deepep, buffers=BUFFERS,
          param_dtypes=("bfloat16",), why_dtype="DeepEP combines bf16 rows", one_node="DeepEP's kernels are intranode",
          tuned=True, shared=_deepep_buffer, missing=_deep_ep_missing, machine=_deepep_machine),
    Entry("all_gather", (2,), "every token goes to every EP rank", _all_gather,
          overlaps=("none",), why_overlap="its exchanges finish where they start",
          shared=lambda group, device, settings, hidden: build_transport(group, device), machine=_all_gather_machine),
]}
NAMES = tuple(DISPATCHERS)


def get(name: str) -> Entry:
    if name not in DISPATCHERS:
        raise ValueError(f"no dispatcher {name!r}: expected one of {', '.join(NAMES)}")
    return DISPATCHERS[name]


def usable(run: Run) -> list[Entry]:
    """The dispatchers whose rules take `run` (the machine not asked), in DISPATCHERS' order."""
    return [e for e in DISPATCHERS.values() if e.problem(run) is None]


def default(run: Run) -> Entry:
    """What a run gets when nothing says better: the first dispatcher that takes it and needs nothing of the
    machine (local at EP = 1, all_to_all above)."""
    return next(e for e in usable(run) if e.missing is None and e.machine is None)
