"""Which dispatcher a run gets, and why (build_dispatchers logs the reason once).

    a dispatcher   as [dispatch] backend says (the config checks matched it to the run). One that needs
                   the machine's say (deepep: the deep_ep library, the EP group on one node with peer
                   access, shapes its kernels take) asks it first: a machine that cannot run it is an
                   error, before step 1. deepep takes the settings of the tuned entry that matches the
                   run, else DeepEP's defaults (24 SMs); [dispatch] num_sms overrides the SM count.
    auto           EP = 1: local. EP > 1: of the tuned entry that matches the run, its fastest dispatcher
                   that this run and machine can use (its `best` first, then by time); the registry's
                   default (all_to_all) without one.
A tuned file that does not parse, or names more SMs than the GPU has, is an error either way. What
each dispatcher takes, and what it needs of the machine, is dispatch/registry.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from torchtitan_moe.config.sections import DISPATCH_KEYS, ConfigError, dispatch_run, dispatch_unavailable
from torchtitan_moe.dispatch import registry
from torchtitan_moe.dispatch.deepep_backend import DeepEPSettings, default_settings
from torchtitan_moe.parallel import tuned

TUNER = "python -m torchtitan_moe.tools.tune_dispatch CONFIG"


@dataclass
class Choice:
    backend: str  # a name of dispatch/registry.py
    settings: DeepEPSettings | None  # a tuned dispatcher's (deepep)
    reason: str  # one line for the log


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
    return "MoE layer forward + backward " + " vs ".join(f"{k} {ms[k]:.2f} ms" for k in sorted(ms, key=ms.get))


def _why_not(name: str, run: registry.Run, group: dist.ProcessGroup | None) -> str | None:
    """Why this run (its config, then its machine) cannot use dispatcher `name`, or None. May be collective."""
    entry = registry.get(name)
    return entry.problem(run, DISPATCH_KEYS) or entry.machine_problem(group, run)


def choose_dispatcher(cfg, shape: tuned.Shape, group: dist.ProcessGroup | None, device_sms: int | None) -> Choice:
    """`cfg`: the job config ([dispatch], [training]); `shape`: this run's tuned-table key."""
    backend = cfg.dispatch.backend
    run = dispatch_run(cfg, shape.ep, gpus=device_sms is not None, hidden=shape.hidden, top_k=shape.top_k,
                       experts=shape.experts)
    if backend == "auto" and shape.ep == 1:
        name = registry.default(run).name
        return Choice(name, None, f"{name} (EP = 1)")
    if backend != "auto" and not registry.get(backend).tuned:  # no tuned settings: the file is not read
        why = registry.get(backend).machine_problem(group, run)
        if why:
            raise ConfigError(dispatch_unavailable(backend, run, why))
        return Choice(backend, None, f"{backend} ([dispatch] backend)")

    user_file = cfg.dispatch.tuned_file
    found = tuned.lookup(user_file, shape)
    path = found[0] if found else (f"{user_file} or the shipped table" if user_file else "the shipped table")
    entry = None
    if found:
        tuned.check_device(found[2], found[1], path, device_sms)
        entry = found[2]

    if backend != "auto":  # a tuned dispatcher (deepep), asked for by name
        why = registry.get(backend).machine_problem(group, run)
        if why:
            raise ConfigError(dispatch_unavailable(backend, run, why))
        settings, why = _deepep_settings(cfg, shape, entry, path, device_sms)
        return Choice(backend, settings, f"{backend}: {why}")

    # auto at EP > 1
    fallback = registry.default(run).name
    if entry is None:
        return Choice(fallback, None, f"auto: {fallback}, no tuned entry for {shape.describe()} in {path} "
                                      f"(measure with {TUNER})")
    where = f"{path} for {entry.shape.describe()} ({_timings(entry)})"
    others = sorted((n for n in entry.layer_ms if n != entry.best and n in registry.DISPATCHERS), key=entry.layer_ms.get)
    passed_over = []
    for name in [entry.best, *others]:
        why = _why_not(name, run, group)
        if why is None:
            break
        passed_over.append(f"; not {name}: {why}")
    else:
        name = fallback
    fastest = "the fastest" if not passed_over else "the fastest this run can use"
    reason = f"auto: {name}, {fastest} in {where}" + "".join(passed_over)
    if not registry.get(name).tuned:
        return Choice(name, None, reason)
    settings, why = _deepep_settings(cfg, shape, entry, path, device_sms)
    return Choice(name, settings, f"{reason}; {why}")
