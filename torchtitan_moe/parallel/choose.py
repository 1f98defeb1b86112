"""Which dispatcher a run gets, and why (build_dispatchers logs the reason once).

    local, all_to_all   as [dispatch] backend says (the config checks matched them to the EP degree)
    deepep              DeepEP with the settings of the tuned entry that matches the run, else
                        DeepEP's defaults (24 SMs); [dispatch] num_sms overrides the SM count.
                        A node that cannot run it (no deep_ep, EP across nodes, no peer access)
                        is an error, before step 1.
    auto                EP = 1: local. EP > 1: the fastest dispatcher of the tuned entry that matches
                        the run, deepep or all_gather only where this run can use it (else the faster of
                        the others); all_to_all without one.
A tuned file that does not parse, or names more SMs than the GPU has, is an error either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.parallel import tuned
from torchtitan_moe.dispatch.all_gather import EP_SIZES
from torchtitan_moe.dispatch.peer_memory import peers_problem
from torchtitan_moe.dispatch.deepep_backend import (
    DeepEPSettings,
    DeepEPUnavailable,
    check_group,
    default_settings,
    import_deep_ep,
    shape_problem,
)

TUNER = "python -m torchtitan_moe.tools.tune_dispatch CONFIG"


@dataclass
class Choice:
    backend: str  # "local", "all_to_all", "deepep" or "all_gather"
    settings: DeepEPSettings | None  # deepep's
    reason: str  # one line for the log


def deepep_preflight(group: dist.ProcessGroup, shape: tuned.Shape) -> None:
    """Raise DeepEPUnavailable unless this run can use DeepEP. Collective over `group`."""
    import_deep_ep()
    problem = shape_problem(shape.hidden, shape.top_k, shape.experts // shape.ep)
    if problem:
        raise DeepEPUnavailable(problem)
    check_group(group)


def _deepep_settings(cfg, shape: tuned.Shape, entry: tuned.TunedEntry | None, path: str,
                     device_sms: int | None) -> tuple[DeepEPSettings, str]:
    num_sms = cfg.dispatch.num_sms
    if num_sms and device_sms is not None and num_sms > device_sms:
        raise ConfigError(f"[dispatch] num_sms = {num_sms}: this {shape.gpu} has {device_sms} SMs")
    if num_sms and not (entry and entry.deepep.num_sms == num_sms):
        settings = default_settings(shape.ep, num_sms)
        return settings, f"{settings.describe()} ([dispatch] num_sms, DeepEP's default chunks)"
    if entry:
        return entry.deepep, f"{entry.deepep.describe()}, tuned for {entry.shape.tokens_per_rank} tokens/rank"
    settings = default_settings(shape.ep)
    return settings, f"DeepEP's defaults, {settings.describe()} (no tuned entry for {shape.describe()} in {path})"


def _timings(entry: tuned.TunedEntry) -> str:
    ms = entry.layer_ms
    return "MoE layer forward + backward " + " vs ".join(f"{k} {ms[k]:.2f} ms" for k in tuned.BACKENDS if k in ms)


def choose_dispatcher(cfg, shape: tuned.Shape, group: dist.ProcessGroup | None, device_sms: int | None) -> Choice:
    """`cfg`: the job config ([dispatch], [training]); `shape`: this run's tuned-table key."""
    backend = cfg.dispatch.backend
    if backend == "local" or (backend == "auto" and shape.ep == 1):
        return Choice("local", None, "local (EP = 1)" if backend == "auto" else "local ([dispatch] backend)")
    if backend == "all_to_all":
        return Choice("all_to_all", None, "all_to_all ([dispatch] backend)")
    if backend == "all_gather":
        return Choice("all_gather", None, "all_gather ([dispatch] backend)")

    user_file = cfg.dispatch.tuned_file
    found = tuned.lookup(user_file, shape)
    path = found[0] if found else (f"{user_file} or the shipped table" if user_file else "the shipped table")
    entry = None
    if found:
        tuned.check_device(found[2], found[1], path, device_sms)
        entry = found[2]

    if backend == "deepep":
        try:
            deepep_preflight(group, shape)
        except DeepEPUnavailable as e:
            raise ConfigError(f"[dispatch] backend = 'deepep': {e}") from None
        settings, why = _deepep_settings(cfg, shape, entry, path, device_sms)
        return Choice("deepep", settings, f"deepep: {why}")

    # auto at EP > 1
    if entry is None:
        return Choice("all_to_all", None, f"auto: all_to_all, no tuned entry for {shape.describe()} in {path} "
                                          f"(measure with {TUNER})")
    where = f"{path} for {entry.shape.describe()} ({_timings(entry)})"
    best, passed_over = entry.best, ""
    if best == "all_gather":
        blocker = _all_gather_blocker(cfg, shape, group, device_sms)
        if blocker is None:
            return Choice("all_gather", None, f"auto: all_gather, the fastest in {where}")
        passed_over = f"all_gather is the fastest there, but {blocker}; "
        ms = entry.layer_ms
        best = "deepep" if ms.get("deepep", math.inf) < ms.get("all_to_all", math.inf) else "all_to_all"
    if best == "all_to_all":
        return Choice("all_to_all", None, f"auto: {passed_over}all_to_all, faster than deepep in {where}")
    if cfg.training.mixed_precision_param != "bfloat16":
        blocker = "DeepEP needs [training] mixed_precision_param = 'bfloat16'"
    else:
        try:
            deepep_preflight(group, shape)
            blocker = None
        except DeepEPUnavailable as e:
            blocker = str(e)
    if blocker:
        return Choice("all_to_all", None, f"auto: {passed_over}all_to_all; deepep is faster in {where}, but {blocker}")
    settings, why = _deepep_settings(cfg, shape, entry, path, device_sms)
    return Choice("deepep", settings, f"auto: {passed_over}deepep, faster in {where}; {why}")


def _all_gather_blocker(cfg, shape: tuned.Shape, group: dist.ProcessGroup | None, device_sms: int | None) -> str | None:
    """Why this run cannot use the all_gather dispatcher, or None. Collective over `group` on GPUs."""
    if shape.ep not in EP_SIZES:
        return f"it takes EP = 2, not {shape.ep}"
    if cfg.dispatch.overlap != "none":
        return f"it has no [dispatch] overlap = {cfg.dispatch.overlap!r}"
    if device_sms is not None and group is not None:  # on GPUs: the copy-engine transport's peers
        return peers_problem(group)
    return None
