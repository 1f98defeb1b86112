"""The tuned dispatcher table: what `python -m torchtitan_moe.tools.tune_dispatch` measured.

`[dispatch] backend = "auto"` reads it to choose a dispatcher, `"deepep"` for its settings.
A JSON file: the package ships `tuned_dispatch.json` beside this module (SHIPPED: entries
measured by tune_dispatch, each with its date, torch and DeepEP versions); a user's own
([dispatch] tuned_file, e.g. tune_dispatch's output) is looked up first, the shipped one after it:

    {"version": 1, "entries": [
      {"gpu": "NVIDIA H200", "ep": 2, "hidden": 2048, "top_k": 8, "experts": 128, "tokens_per_rank": 8192,
       "best": "deepep",                      # the fastest MoE layer forward + backward (all_gather: at EP = 2)
       "deepep": {"num_sms": 64, "dispatch_chunk": 16, "combine_chunk": 8, "buffer_tokens": 256},
       "layer_ms": {"deepep": 9.8, "all_to_all": 11.9},            # MoE layer forward + backward
       "dispatch_combine_ms": {"deepep": 0.8, "all_to_all": 2.9},  # dispatch + combine, fwd + bwd
       "deep_ep_commit": "...", "torch": "...", "date": "..."}]}

An entry matches a run of the same GPU model, EP degree, hidden size, top-k and experts
whose tokens per rank are within a factor of 2 of the entry's; the nearest wins.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.dispatch import registry
from torchtitan_moe.dispatch.deepep_backend import DeepEPSettings

VERSION = 1
# Entries measured on H200s. EP = 2: tune_dispatch on 2 H200s (configs/qwen3_30b_a3b_8l.toml,
# 8192 tokens/rank, DeepEP 567632d, torch 2.11.0+cu130); each entry records its versions and the day it was tuned.
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_dispatch.json")


@dataclass(frozen=True)
class Shape:
    """What a tuned entry is measured for, and the key a run looks up."""

    gpu: str
    ep: int
    hidden: int
    top_k: int
    experts: int
    tokens_per_rank: int

    def describe(self) -> str:
        return (f"{self.gpu}, EP {self.ep}, hidden {self.hidden}, top-{self.top_k}, {self.experts} experts, "
                f"{self.tokens_per_rank} tokens/rank")


@dataclass
class TunedEntry:
    shape: Shape
    best: str  # a dispatcher of dispatch/registry.py
    deepep: DeepEPSettings
    layer_ms: dict[str, float]
    dispatch_combine_ms: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # provenance: commit, torch, date

    def to_json(self) -> dict:
        return {**asdict(self.shape), "best": self.best, "deepep": asdict(self.deepep), "layer_ms": self.layer_ms,
                "dispatch_combine_ms": self.dispatch_combine_ms, **self.extra}


def _entry(raw, where: str) -> TunedEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table, got {raw!r}")
    try:
        shape = Shape(str(raw["gpu"]), *(int(raw[k]) for k in ("ep", "hidden", "top_k", "experts", "tokens_per_rank")))
        settings = DeepEPSettings(**{k: int(v) for k, v in raw["deepep"].items()})
        layer_ms = {k: float(v) for k, v in raw["layer_ms"].items()}
        combine_ms = {k: float(v) for k, v in raw.get("dispatch_combine_ms", {}).items()}
        best = raw["best"]
    except KeyError as e:
        raise ConfigError(f"{where}: missing key {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if best not in registry.DISPATCHERS:
        raise ConfigError(f"{where}: best = {best!r}: expected one of {', '.join(registry.NAMES)}")
    if best not in layer_ms:
        raise ConfigError(f"{where}: best = {best!r} has no time in layer_ms ({', '.join(layer_ms) or 'empty'})")
    problem = settings.problem()
    if problem:
        raise ConfigError(f"{where}: deepep {problem}")
    known = set(asdict(shape)) | {"best", "deepep", "layer_ms", "dispatch_combine_ms"}
    return TunedEntry(shape, best, settings, layer_ms, combine_ms, {k: v for k, v in raw.items() if k not in known})


def load(path: str) -> list[TunedEntry]:
    """The file's entries ([] when there is no file). A file that does not parse is refused in one line."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"[dispatch] tuned_file = {path!r}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ConfigError(f"[dispatch] tuned_file = {path!r}: expected {{\"version\": {VERSION}, \"entries\": [...]}}")
    if data.get("version") != VERSION:
        raise ConfigError(f"[dispatch] tuned_file = {path!r}: version {data.get('version')!r}, this code reads {VERSION}")
    return [_entry(raw, f"[dispatch] tuned_file = {path!r}, entry {i}") for i, raw in enumerate(data["entries"])]


def match(entries: list[TunedEntry], shape: Shape) -> tuple[int, TunedEntry] | None:
    """(index, entry) for `shape`: same GPU, EP, hidden, top-k, experts; nearest tokens within 2x."""
    same = [(i, e) for i, e in enumerate(entries)
            if (e.shape.gpu, e.shape.ep, e.shape.hidden, e.shape.top_k, e.shape.experts)
            == (shape.gpu, shape.ep, shape.hidden, shape.top_k, shape.experts)]
    distance = [(abs(math.log2(e.shape.tokens_per_rank / shape.tokens_per_rank)), i, e) for i, e in same]
    near = [d for d in distance if d[0] <= 1.0]
    if not near:
        return None
    _, i, e = min(near, key=lambda d: d[0])
    return i, e


def load_named(path: str) -> list[TunedEntry]:
    """The entries of a file a user named in [dispatch] tuned_file: it must exist and parse."""
    if not os.path.exists(path):
        raise ConfigError(f"[dispatch] tuned_file = {path!r}: no such file (leave it unset for the table shipped "
                          "with the package, or measure one with python -m torchtitan_moe.tools.tune_dispatch CONFIG)")
    return load(path)


def lookup(path: str, shape: Shape) -> tuple[str, int, TunedEntry] | None:
    """(file, index, entry) for `shape`: the user's file `path` ("" for none) first, then SHIPPED."""
    for source in ([path] if path else []) + [SHIPPED]:
        found = match(load_named(source), shape)
        if found:
            return (source, *found)
    return None


def check_device(entry: TunedEntry, index: int, path: str, device_sms: int | None) -> None:
    """Refuse an entry whose num_sms this GPU does not have."""
    if device_sms is not None and entry.deepep.num_sms > device_sms:
        raise ConfigError(f"[dispatch] tuned_file = {path!r}, entry {index}: num_sms = {entry.deepep.num_sms} but this "
                          f"{entry.shape.gpu} has {device_sms} SMs")


def save(path: str, entry: TunedEntry) -> None:
    """Add `entry` to the file, replacing one of the same shape (other entries are kept)."""
    entries = [e for e in load(path) if e.shape != entry.shape] + [entry]
    entries.sort(key=lambda e: tuple(asdict(e.shape).values()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": VERSION, "entries": [e.to_json() for e in entries]}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
