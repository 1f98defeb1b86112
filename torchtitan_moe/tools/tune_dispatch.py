"""Tune the dispatcher for this node's GPUs and a config's shapes.

    torchrun --standalone --nproc_per_node N -m torchtitan_moe.tools.tune_dispatch CONFIG [--section.key value ...]
        [--out FILE] [--json FILE] [--num-sms 16,24,...] [--dispatch-chunks ...] [--combine-chunks ...]

EP = N (2, 4 or 8: one process per GPU). For the config's hidden size, experts, top-k and tokens
per rank (local_batch_size x seq_len) it measures, for the all-to-all dispatcher, the all-gather
dispatcher (EP = 2) and DeepEP at each num_sms (a fresh DeepEP buffer per value):
  (a) dispatch + combine, forward + backward, through the dispatcher API (no expert GEMMs);
      for DeepEP this picks the dispatch chunk size, then the combine chunk size;
  (b) the MoE layer forward + backward (router, dispatch, grouped experts, combine).
Then (b) again for all_to_all, all_gather and the DeepEP settings with the fastest (b), head to head: their
runs taken in turn (timed_interleaved), since the sweep measured them minutes apart and a
host-bound path drifts with the host by tens of percent within one call. It prints the table and
writes into the tuned file (--out, default [dispatch] tuned_file) those DeepEP settings and which
dispatcher was fastest head to head; `[dispatch] backend = "deepep"` takes those settings and
`"auto"` that choice. Times are medians over --iters runs after --warmup, each run started on all
ranks together (a barrier), timed with CUDA events, the slowest rank's median.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.dispatch import registry
from torchtitan_moe.parallel import tuned
from torchtitan_moe.dispatch.deepep_backend import (
    DEEPEP_COMMIT,
    DeepEPSettings,
    DeepEPUnavailable,
    default_settings,
    import_deep_ep,
    release_buffers,
)
from torchtitan_moe.moe.layer import MoE
from torchtitan_moe.dispatch.seam import Routing

NUM_SMS = (16, 24, 32, 48, 64, 96, 128)
DISPATCH_CHUNKS = (4, 8, 16, 24, 32)
COMBINE_CHUNKS = (2, 4, 8, 12, 16)


def _run_ms(fn, group, runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls of fn(), each started together on every rank of `group`."""
    times = []
    for _ in range(runs):
        dist.barrier(group=group)
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def max_over_ranks(value: float, group) -> float:
    """The largest of the ranks' values (the slowest rank sets the step)."""
    t = torch.tensor(value, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def timed_ms(fn, group, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() on this rank over `iters` runs after `warmup`, each run
    started together on every rank of `group`; the maximum of the ranks' medians."""
    for _ in range(warmup):
        fn()
    return max_over_ranks(statistics.median(_run_ms(fn, group, iters)), group)


def timed_interleaved(fns: dict, group, warmup: int, iters: int, rounds: int = 5) -> dict[str, float]:
    """timed_ms of each fn, its `iters` runs spread over `rounds` rounds that take the fns in turn
    (every other round in reverse): a host-bound fn's time drifts with the host by tens of percent
    within one call, and interleaving makes every fn see the same drift, so their ratios hold."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += _run_ms(fns[name], group, max(1, iters // rounds))
    return {name: max_over_ranks(statistics.median(t), group) for name, t in times.items()}


class Progress:
    """A progress bar on rank 0's stderr (one line per step where stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        bar = "#" * (30 * self.done // self.total)
        line = f"[{bar:<30}] {self.done}/{self.total} {label}"
        print(f"\r{line:<100}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)
        if self.tty and self.done == self.total:
            print(file=sys.stderr)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.tools.tune_dispatch", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("config")
    parser.add_argument("--out", default=None, help="tuned file to write (default: the config's [dispatch] tuned_file, else "
                        "tuned_dispatch.json here; name it in [dispatch] tuned_file to use it)")
    parser.add_argument("--json", default=None, help="also write every measurement here")
    parser.add_argument("--num-sms", type=ints, default=NUM_SMS)
    parser.add_argument("--dispatch-chunks", type=ints, default=DISPATCH_CHUNKS)
    parser.add_argument("--combine-chunks", type=ints, default=COMBINE_CHUNKS)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    return parser.parse_known_args(argv)  # the rest are config overrides


def build_layer(model_args, ep: int, rank: int, device: torch.device) -> MoE:
    """One MoE layer of the config, this rank's expert shard, bf16 experts and an fp32 router
    (what FSDP2 mixed precision computes with); the same weights on every rank."""
    torch.manual_seed(0)
    with torch.device(device):
        # It times the exchange: no balance loss (its counts need the data-parallel group) or bias update.
        router = replace(model_args.moe.router, bias_update_rate=0.0, balance_loss="none", balance_loss_coeff=0.0)
        layer = MoE(replace(model_args.moe, router=router), model_args.dim)
        layer.init_weights(out_std=0.02, buffer_device=device)
    local = layer.num_experts // ep
    mine = slice(rank * local, (rank + 1) * local)
    for name in ("w13", "w2"):
        weight = getattr(layer.experts, name).detach()[mine].to(torch.bfloat16)
        setattr(layer.experts, name, nn.Parameter(weight.clone()))
    return layer


class Sweep:
    def __init__(self, layer: MoE, x: torch.Tensor, group, run: registry.Run, args, progress: Progress):
        self.layer, self.x, self.group, self.run, self.args, self.progress = layer, x, group, run, args, progress
        self.grad = torch.randn_like(x)
        with torch.no_grad():
            r = layer.router(x)
        self.routing = Routing(r.probs.detach().requires_grad_(), r.experts, r.tokens_per_expert, r.scores, None)
        self.kernels, self.align = layer.dispatch_settings(x.device)
        self.rows: list[dict] = []  # every measurement
        self.builders: dict = {}  # the fixed dispatchers' (what they share, e.g. a transport, made once)

    def _time(self, fn, label: str) -> float:
        ms = timed_ms(fn, self.group, self.args.warmup, self.args.iters)
        self.progress.step(label)
        return ms

    def dispatch_combine_ms(self, dispatcher, label: str) -> float:
        def step():
            xg = self.x.detach().requires_grad_()
            batch = dispatcher.start_dispatch(xg, self.routing).wait()
            dispatcher.start_combine(batch.x, batch).wait().backward(self.grad)

        return self._time(step, label)

    def layer_step(self, dispatcher):
        """(b): one forward + backward of the MoE layer through `dispatcher`."""
        x, grad = self.x.unsqueeze(0), self.grad.unsqueeze(0)

        def step():
            self.layer.set_dispatcher(dispatcher)
            self.layer(x.detach().requires_grad_()).backward(grad)

        return step

    def layer_ms(self, dispatcher, label: str) -> float:
        return self._time(self.layer_step(dispatcher), label)

    def dispatcher(self, name: str, settings: DeepEPSettings | None = None):
        """A dispatcher of the registry for this layer; a tuned one (deepep) anew for `settings` (its buffer)."""
        entry = registry.get(name)
        if entry.tuned:
            return entry.builder(self.run, self.group, self.x.device, settings, self.x.shape[1])(
                self.layer.num_experts, self.align, self.kernels)
        if name not in self.builders:
            self.builders[name] = entry.builder(self.run, self.group, self.x.device, hidden=self.x.shape[1])
        return self.builders[name](self.layer.num_experts, self.align, self.kernels)

    def fixed(self, name: str) -> dict:
        """(a) and (b) of a dispatcher with nothing to tune (all_to_all, all_gather)."""
        d = self.dispatcher(name)
        row = {"dispatcher": name, "dispatch_combine_ms": self.dispatch_combine_ms(d, f"{name} (a)"),
               "layer_ms": self.layer_ms(d, f"{name} (b)")}
        self.rows.append(row)
        return row

    def deepep(self, num_sms: int) -> dict:
        """Chunk sizes by (a), dispatch's then combine's; then (b) with the best pair."""
        release_buffers(self.group)  # a fresh buffer for this num_sms
        base = default_settings(dist.get_world_size(self.group), num_sms)

        def measure(settings: DeepEPSettings, what: str) -> float:
            ms = self.dispatch_combine_ms(self.dispatcher("deepep", settings), f"deepep {num_sms} SMs, {what}")
            self.rows.append({"dispatcher": "deepep", **settings.__dict__, "dispatch_combine_ms": ms})
            return ms

        chunks = sorted(set(self.args.dispatch_chunks) | {base.dispatch_chunk})
        timings = {c: measure(replace(base, dispatch_chunk=c), f"dispatch chunk {c}") for c in chunks}
        best = replace(base, dispatch_chunk=min(timings, key=timings.get))
        chunks = sorted(set(self.args.combine_chunks) | {base.combine_chunk})
        timings = {c: measure(replace(best, combine_chunk=c), f"combine chunk {c}") for c in chunks}
        best = replace(best, combine_chunk=min(timings, key=timings.get))
        row = {"dispatcher": "deepep", "settings": best, "dispatch_combine_ms": timings[best.combine_chunk],
               "layer_ms": self.layer_ms(self.dispatcher("deepep", best), f"deepep {num_sms} SMs (b)")}
        self.rows.append({**{k: v for k, v in row.items() if k != "settings"}, **best.__dict__})
        return row

    def head_to_head(self, names: list[str], best: DeepEPSettings) -> dict[str, float]:
        """(b) of the dispatchers `names`, deepep with `best`, their runs taken in turn."""
        release_buffers(self.group)  # `best` may have another num_sms than the last buffer
        steps = {name: self.layer_step(self.dispatcher(name, best if registry.get(name).tuned else None))
                 for name in names}
        ms = timed_interleaved(steps, self.group, self.args.warmup, self.args.iters)
        self.rows.append({"dispatcher": "head to head", **{f"{name}_layer_ms": v for name, v in ms.items()}})
        self.progress.step(f"{', '.join(steps)} (b), in turn")
        return ms


def report(shape: tuned.Shape, fixed: dict[str, dict], deepep: list[dict], best: dict, final: dict[str, float],
           path: str, base: str) -> str:
    a2a = fixed[base]
    lines = [f"dispatch tuning: {shape.describe()}, bf16",
             "(a) dispatch + combine, forward + backward, through the dispatcher; (b) MoE layer forward + backward",
             f"| dispatcher | num_sms | dispatch chunk | combine chunk | (a) ms | (b) ms | (b) {base} / this |",
             "|---|---|---|---|---|---|---|"]
    for name, row in fixed.items():
        lines.append(f"| {name} | - | - | - | {row['dispatch_combine_ms']:.3f} | {row['layer_ms']:.3f} | "
                     f"{a2a['layer_ms'] / row['layer_ms']:.2f}x |")
    for row in deepep:
        s = row["settings"]
        lines.append(f"| deepep | {s.num_sms} | {s.dispatch_chunk} | {s.combine_chunk} | {row['dispatch_combine_ms']:.3f} "
                     f"| {row['layer_ms']:.3f} | {a2a['layer_ms'] / row['layer_ms']:.2f}x |")
    s = best["settings"]
    others = " vs ".join(f"{name} {ms:.3f} ms" for name, ms in final.items() if name != "deepep")
    lines.append(f"fastest by (b) head to head, in turn: {min(final, key=final.get)}; best DeepEP: {s.describe()}, "
                 f"MoE layer {final['deepep']:.3f} ms vs {others}; wrote {path}")
    return "\n".join(lines)


def tune(args: argparse.Namespace, overrides: list[str]) -> int:
    from torchtitan_moe.train.job_config import load_job_config
    from torchtitan_moe.models.qwen3_moe import flavor_args

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    # Timed as training runs: bf16, one dispatch per forward.
    run = registry.Run(ep, gpus=torch.cuda.is_available())
    problem = registry.get("deepep").problem(run)
    if problem:
        raise ConfigError(f"tune_dispatch tunes DeepEP, which {problem}: run one process per GPU "
                          "(torchrun --standalone --nproc_per_node N -m torchtitan_moe.tools.tune_dispatch CONFIG)")
    import_deep_ep()
    config = load_job_config(["--job.config_file", args.config, *overrides, "--dispatch.backend", "auto",
                              "--parallelism.expert_parallel_degree", str(ep)])
    model_args = flavor_args(config.model.flavor)
    model_args.update_from_config(config)

    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    group = dist.group.WORLD
    try:
        layer = build_layer(model_args, ep, rank, device)
        tokens = config.training.local_batch_size * config.training.seq_len
        gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
        shape = tuned.Shape(gpu, ep, model_args.dim, layer.args.top_k, layer.num_experts, tokens)
        device_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
        num_sms = [n for n in args.num_sms if device_sms is None or n <= device_sms]
        bad = [n for n in num_sms if n < 2 or n % 2]
        if bad or not num_sms:
            raise ConfigError(f"tune_dispatch: --num-sms {bad or args.num_sms}: need even numbers >= 2, at most "
                              f"the GPU's {device_sms} SMs")
        per_sms = len(set(args.dispatch_chunks) | {default_settings(ep).dispatch_chunk}) + \
            len(set(args.combine_chunks) | {default_settings(ep).combine_chunk}) + 1
        # Every dispatcher that takes this run: those with nothing to tune timed once, DeepEP per setting.
        names = [e.name for e in registry.usable(run)]
        untuned = [name for name in names if not registry.get(name).tuned]
        progress = Progress(1 + 2 * len(untuned) + len(num_sms) * per_sms, enabled=rank == 0)
        torch.manual_seed(1000 + rank)  # other tokens on every rank
        x = torch.randn(tokens, model_args.dim, device=device, dtype=torch.bfloat16)
        sweep = Sweep(layer, x, group, run, args, progress)

        fixed = {name: sweep.fixed(name) for name in untuned}
        deepep = [sweep.deepep(n) for n in num_sms]
        best = min(deepep, key=lambda row: row["layer_ms"])
        final = sweep.head_to_head(names, best["settings"])
        path = args.out or config.dispatch.tuned_file or "tuned_dispatch.json"
        if rank == 0:
            try:
                version = importlib.metadata.version("deep_ep")
            except importlib.metadata.PackageNotFoundError:
                version = "unknown"
            entry = tuned.TunedEntry(
                shape, min(final, key=final.get), best["settings"],
                layer_ms={name: round(ms, 4) for name, ms in final.items()},
                dispatch_combine_ms={"deepep": round(best["dispatch_combine_ms"], 4),
                                     **{name: round(row["dispatch_combine_ms"], 4) for name, row in fixed.items()}},
                extra={"deep_ep_version": version, "deep_ep_pinned": DEEPEP_COMMIT, "torch": torch.__version__,
                       "date": datetime.date.today().isoformat()})
            tuned.save(path, entry)
            print(report(shape, fixed, deepep, best, final, path, registry.default(run).name), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"shape": shape.__dict__, "entry": entry.to_json(), "rows": sweep.rows}, f, indent=1,
                              default=lambda o: o.__dict__)
        release_buffers(group)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return tune(args, overrides)
    except (ConfigError, DeepEPUnavailable) as e:
        print(f"tune_dispatch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
