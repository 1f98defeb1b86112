"""Training-step benchmark: torchtitan's own Qwen3-MoE against ours, same config, same tokens.

    python -m torchtitan_moe.tools.bench_train CONFIG [--steps 30] [--warmup 5] [--nproc N]
        [--models torchtitan,all_to_all,deepep] [--routers learned,balanced]
        [--modes eager,compiled] [--grad-accum 1,8] [--vary section.key=v1,v2 ...] [--log-freq 1]
        [--repeat 1] [--seed 0] [--gpu-power] [--profile] [--out DIR] [--report | --resume]
        [-- --section.key value ...]

Trains every combination of model (torchtitan's "torchtitan_qwen3_moe", or ours with each
dispatcher that runs here), router (learned, or forced balance) and mode (eager, compiled)
one after the other on this node, from the same config and data, and prints one table:
tokens/s/GPU (median of the logged steps after --warmup; with --log-freq N each logged figure is the
mean of the N steps before it), the tokens a step trains (the global batch: local batch x seq x processes
x --grad-accum), TFLOP/s and MFU in torchtitan's count and MFU in the causal count (components/flops.py),
tokens per joule (--gpu-power), peak memory and the final loss, with the ratios to torchtitan eager and
compiled with the same router, measured in this run; then, for each model and router run both ways, how far the compiled loss is from the
eager one (at the last step, and over the last LOSS_WINDOW steps: compiling must not change
training). Writes `bench_train.md`, `bench_train.json` and `bench_train.png` (loss curves:
the variants should train alike) to --out. Every run of a model starts from the same weights: [debug]
seed is the config's or the overrides', else --seed (where none is set, torchtitan draws new weights
each run). A variant that fails is reported as failed, with its log, and the others still run.
torchtitan's MoE runs on CUDA only.

--vary section.key=v1,v2 (repeatable) trains each of our variants once per combination of the
values (torchtitan's once, as configured) and adds a table of each combination against the first
one, same run: e.g. `--vary dispatch.overlap=none,chunks`, `--vary dispatch.buffers=exact,worst_case`,
`--vary optimizer.moments_dtype=float32,bfloat16`, `--vary data.attention=causal,document` (document masking's cost,
with `-- --training.dataset shards --training.dataset_path DIR`), `--vary training.local_batch_size=12,16` (each
row's tokens a step its own). Every combination is checked as a config first; a varied key also set after `--`
(which would override it) is refused.

--repeat K trains every variant K times, in K rounds of all variants (so a slow spell of the machine falls on
every variant alike), every second round in the reverse order (A B, B A, ...: on 2 H200s the second of two
runs ran ~1% faster in either order): the table gives the median of
the runs' tokens/s with their range, and --vary's ratios are the median of each round's ratio, with their range.
On 2 H200s one setting's runs spread by up to 6%: a change of 1-2%
needs several rounds to show.

--gpu-power samples every GPU's power draw, SM clock, temperature and clock-limit reasons with nvidia-smi through each run
(torchtitan_moe/tools/gpu_power.py) and adds a table of their medians over each run's timed steps, over the GPUs the
run used (CUDA_VISIBLE_DEVICES, else the first --nproc): a run slower because its GPUs ran slower (at the power cap,
or hot) shows there; one slower at the same clocks points at the host. Its tokens per joule (tokens/s/GPU over those
GPUs' mean watts) is what a change must raise where the GPUs run at the cap.

--report trains nothing: it writes the tables of the runs already in --out, given the arguments they ran
with (a bench stopped before its tables, e.g. by a time limit after its last run's timed steps).

--resume trains only the runs that did not finish in --out (a bench a time limit stopped, e.g. a device call's):
the finished ones are read back as --report reads them, and the rounds keep their order.

--profile also traces the last PROFILED_STEPS steps of every variant (torch.profiler through
torchtitan's [profiling]; those steps are left out of the medians) and adds each variant's step-time
breakdown to the report: GPU busy and idle, launches, host syncs, GPU time per kernel class, the
top kernels and the idle time by the host op behind each gap (torchtitan_moe.tools.step_profile), from
rank 0's trace, and the ranks side by side where there are several.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_moe.dispatch import registry
from torchtitan_moe.tools import gpu_power, step_profile
from torchtitan_moe.tools.parity import log_tail, override, run_training, settings_from, split_overrides
from torchtitan_moe.tools.parity_report import read_metrics

MODELS = ("torchtitan", *registry.NAMES)  # torchtitan's MoE, or ours with one of our dispatchers
ROUTERS = ("learned", "balanced")
MODES = ("eager", "compiled")
LOSS_WINDOW = 10  # steps averaged in the eager-vs-compiled loss comparison
PROFILED_STEPS = 3  # traced at the end of a --profile run, after one warm-up step of the profiler


@dataclass
class Variant:
    model: str  # "torchtitan" or one of our dispatchers
    router: str
    mode: str
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    vary: tuple[tuple[str, str], ...] = ()  # ours only: (section.key, value) from --vary

    @property
    def name(self) -> str:
        model = "torchtitan" if self.model == "torchtitan" else f"ours/{self.model}"
        varied = "".join(f" {key}={value}" for key, value in self.vary)
        return f"{model} {self.router} {self.mode}" + (f" accum {self.accum}" if self.accum > 1 else "") + varied

    def value(self, key: str, default: int) -> int:
        """An integer key's value in this variant: its --vary value, else `default` (the config's)."""
        return int(dict(self.vary).get(key, default))

    def global_batch(self, local_batch: int, nproc: int) -> list[str]:
        """torchtitan's global batch for this variant's accumulation (every process is a data-parallel rank)."""
        return [] if self.accum == 1 else ["--training.global_batch_size", str(local_batch * nproc * self.accum)]

    def overrides(self) -> list[str]:
        ours = self.model != "torchtitan"
        args = ["--model.name", "qwen3_moe" if ours else "torchtitan_qwen3_moe"]
        if ours:
            args += ["--dispatch.backend", self.model]
        args += vary_overrides(self.vary)
        if self.router == "balanced":
            args += ["--router.force_balance"] if ours else ["--debug.moe_force_load_balance"]
        args += ["--compile.enable"] if self.mode == "compiled" else ["--compile.no-enable"]
        return args


def available_models(ep: int, param_dtype: str = "bfloat16") -> list[str]:
    """torchtitan's (on CUDA), and ours with every dispatcher that takes the run and whose library is here."""
    run = registry.Run(ep, param_dtype=param_dtype)
    ours = [e.name for e in registry.usable(run) if e.missing is None or e.missing() is None]
    return (["torchtitan"] if torch.cuda.is_available() else []) + ours


def profiling_overrides(steps: int) -> list[str]:
    """torchtitan's profiler on the last PROFILED_STEPS steps (its trace lands in iteration_<steps>)."""
    if steps < PROFILED_STEPS + 2:
        raise SystemExit(f"bench_train: --profile needs --steps >= {PROFILED_STEPS + 2}, got {steps}")
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps),
            "--profiling.profiler_warmup", "1", "--profiling.profiler_active", str(PROFILED_STEPS)]


def profile_of(dump: Path, steps: int) -> dict | None:
    """Rank 0's breakdown, with every rank's under "by_rank" when the run had several."""
    traces = {int(t.name.removeprefix("rank").removesuffix("_trace.json")): t
              for t in (dump / "profile_traces" / f"iteration_{steps}").glob("rank*_trace.json")}
    by_rank = {rank: step_profile.breakdown(step_profile.load(traces[rank])) for rank in sorted(traces)}
    if 0 not in by_rank:
        return None
    return {**by_rank[0], "by_rank": by_rank} if len(by_rank) > 1 else by_rank[0]


FINISHED = "bench_train.finished"  # written in a run's dump folder once its training exited 0


def finished(dump: Path) -> bool:
    """Whether the run in `dump` trained to its end (a run cut off by a time limit left no marker)."""
    return (dump / FINISHED).exists() and (dump / "metrics.jsonl").exists()


def summarize(records: list[dict], warmup: int, last_untimed: int = 0) -> dict:
    """Medians over the steps after `warmup`, leaving out the last `last_untimed` (profiled) ones."""
    end = records[-1]["step"] - last_untimed
    timed = [r for r in records if warmup < r["step"] <= end] or records
    result = {
        "tps": statistics.median(r["throughput(tps)"] for r in timed),
        "tflops": statistics.median(r["tflops"] for r in timed),
        **({"tflops_causal": statistics.median(r["tflops_causal"] for r in timed)} if "tflops_causal" in timed[0] else {}),
        "memory_gib": max(r["memory/max_reserved(GiB)"] for r in records),
        # What the tensors held at most (reserved less the allocator's cached, fragmented blocks), and how often
        # the allocator had to free its cache to fit (a run that retries is memory-bound, not slow by itself).
        **{key: max(r[field] for r in records) for key, field in (("memory_active_gib", "memory/max_active(GiB)"),
                                                                  ("alloc_retries", "memory/num_alloc_retries"))
           if field in records[0]},
        "final_loss": records[-1]["loss"],
        "steps": records[-1]["step"],
        "losses": [r["loss"] for r in records],
        "loss_steps": [r["step"] for r in records],  # the logged steps: every --log-freq-th
    }
    if "mfu(%)" in timed[0]:
        result["mfu"] = statistics.median(r["mfu(%)"] for r in timed)
    if "mfu_causal(%)" in timed[0]:
        result["mfu_causal"] = statistics.median(r["mfu_causal(%)"] for r in timed)
    if "time" in timed[-1]:  # the timed steps ran from the last untimed step's log to the last timed one's
        untimed = [r for r in records if r["step"] <= warmup]
        result["window"] = ((untimed or timed)[-1]["time"], timed[-1]["time"])
    return result


def gpus_during(samples: Path, run: dict, devices: list[str]) -> dict:
    """Each of the run's GPUs' medians (gpu_power.summarize) over the run's timed steps."""
    if "window" not in run:
        raise SystemExit("bench_train: --gpu-power needs the logged steps' times (metrics.jsonl's \"time\")")
    taken = gpu_power.during(gpu_power.read_samples(samples), *run["window"])
    return gpu_power.summarize(gpu_power.on(taken, devices))


def tokens_per_joule(tps: float, gpus: dict) -> float:
    """A run's tokens per joule per GPU: its tokens/s/GPU over its GPUs' mean power (runs from before the mean was
    kept, e.g. read back by --report, fall back to the median)."""
    return tps / statistics.fmean(g.get("mean_watts", g["watts"]) for g in gpus.values())


def gpu_table(variants: list[Variant], results: dict[str, dict]) -> str:
    """One row per run: tokens/s/GPU beside each GPU's median SM clock, power and temperature, the share of samples
    at the power cap or held by heat (GPUs in index order, " / " between them), and tokens per joule per GPU."""
    lines = ["| variant | run | tokens/s/GPU | SM MHz | W | °C | at the power cap | held by heat | tokens/J per GPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = results[v.name]
        if "failed" in r:
            continue
        for i, (tps, gpus) in enumerate(zip(r.get("tps_runs", [r["tps"]]), r.get("gpus_runs", [r.get("gpus")])), 1):
            if not gpus:
                lines.append(f"| {v.name} | {i} | {tps:,.0f} | no samples | | | | | |")
                continue
            cells = [" / ".join(fmt.format(g[key]) for g in gpus.values())
                     for key, fmt in (("sm_mhz", "{:,.0f}"), ("watts", "{:.0f}"), ("celsius", "{:.0f}"),
                                      ("power_cap", "{:.0%}"), ("thermal", "{:.0%}"))]
            cells.append(f"{tokens_per_joule(tps, gpus):,.1f}")
            lines.append(f"| {v.name} | {i} | {tps:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine_runs(runs: list[dict]) -> dict:
    """One variant's --repeat runs as one result: medians of tokens/s, TFLOP/s and MFU, the largest
    peak memory, the first run's losses (same seed and tokens), each run's tokens/s under "tps_runs",
    and the last run's profile."""
    if len(runs) == 1:
        return runs[0]
    result = {**runs[0], "memory_gib": max(r["memory_gib"] for r in runs), "tps_runs": [r["tps"] for r in runs]}
    for key in ("memory_active_gib", "alloc_retries"):
        if key in runs[0]:
            result[key] = max(r[key] for r in runs)
    if "gpus" in runs[0]:
        result["gpus_runs"] = [r["gpus"] for r in runs]
    for key in ("tps", "tflops", "tflops_causal", "mfu", "mfu_causal", "tokens_per_joule"):
        if key in runs[0]:
            result[key] = statistics.median(r[key] for r in runs)
    if "profile" in runs[-1]:
        result["profile"] = runs[-1]["profile"]
    return result


def tps_cell(r: dict) -> str:
    """tokens/s/GPU, with the range and count of the runs behind a --repeat median."""
    runs = r.get("tps_runs", [])
    return f"{r['tps']:,.0f}" + (f" ({min(runs):,.0f}-{max(runs):,.0f}, {len(runs)} runs)" if len(runs) > 1 else "")


def ratio(value: float, base: dict | None) -> str:
    return f"{value / base['tps']:.2f}x" if base and "tps" in base else "-"


def table(variants: list[Variant], results: dict[str, dict]) -> str:
    """One row per variant. MFU in torchtitan's count, then in the causal count; tokens/J per GPU where the GPUs
    were sampled (--gpu-power). Ratios: to torchtitan with the same router and accumulation."""
    lines = ["| variant | tokens/s/GPU | tokens/step | TFLOP/s | MFU | MFU causal | tokens/J per GPU | peak memory GiB "
             "| final loss | / tt eager | / tt compiled |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = results[v.name]
        if "failed" in r:
            lines.append(f"| {v.name} | failed: {r['failed']} | | | | | | | | | |")
            continue
        eager = results.get(dataclasses.replace(v, model="torchtitan", mode="eager", vary=()).name)
        compiled = results.get(dataclasses.replace(v, model="torchtitan", mode="compiled", vary=()).name)
        cells = [f"{r['tokens_per_step']:,}" if "tokens_per_step" in r else "-", f"{r['tflops']:.1f}"]
        cells += [f"{r[key]:.1f}%" if key in r else "-" for key in ("mfu", "mfu_causal")]
        cells.append(f"{r['tokens_per_joule']:,.1f}" if "tokens_per_joule" in r else "-")
        retries = f" ({r['alloc_retries']:,} allocation retries)" if r.get("alloc_retries") else ""
        lines.append(f"| {v.name} | {tps_cell(r)} | " + " | ".join(cells) + f" | {r['memory_gib']:.1f}{retries} | "
                     f"{r['final_loss']:.4f} | {ratio(r['tps'], eager)} | {ratio(r['tps'], compiled)} |")
    return "\n".join(lines)


def vary_gain(variants: list[Variant], results: dict[str, dict], first: tuple[tuple[str, str], ...]) -> str:
    """Each of our variants with another --vary combination against the same variant with the first
    combination: tokens/s and final loss. With --repeat, the ratio is the median of the rounds' ratios
    (each run against the same round's run of the first combination), with their range."""
    lines = []
    for v in variants:
        base = results.get(dataclasses.replace(v, vary=first).name, {})
        mine = results.get(v.name, {})
        if not v.vary or v.vary == first or "tps" not in base or "tps" not in mine:
            continue
        rounds = [b / a for a, b in zip(base.get("tps_runs", []), mine.get("tps_runs", []))]
        gain = (f"{statistics.median(rounds):.3f}x ({min(rounds):.3f}-{max(rounds):.3f})" if len(rounds) > 1
                else f"{mine['tps'] / base['tps']:.3f}x")
        lines.append(f"| {v.name} | {tps_cell(base)} | {tps_cell(mine)} | {gain} | "
                     f"{mine['final_loss'] - base['final_loss']:+.2e} |")
    if not lines:
        return ""
    described = " ".join(f"{key}={value}" for key, value in first)
    return (f"| variant | tokens/s/GPU with {described} | this variant | ratio | final loss - that one's |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines))


def vary_overrides(vary: tuple[tuple[str, str], ...]) -> list[str]:
    return [arg for key, value in vary for arg in override(key, value)]


def vary_combinations(varies: list[str]) -> list[tuple[tuple[str, str], ...]]:
    """["a.b=1,2", "c.d=x"] -> [(("a.b", "1"), ("c.d", "x")), (("a.b", "2"), ("c.d", "x"))]; [] -> [()]."""
    return [tuple(s.values) for s in settings_from(varies)]


def check_combinations(config: str, extra: list[str], combinations: list, nproc: int) -> None:
    """Each --vary combination as our model's config, before anything trains: a bad key or value
    stops here in one line, naming it."""
    from torchtitan_moe.config.sections import ConfigError
    from torchtitan_moe.train.job_config import load_job_config

    after = {a[2:].split("=", 1)[0] for a in extra if a.startswith("--")}  # these come last: they would win
    both = sorted({key for vary in combinations for key, _ in vary} & after)
    if both:
        raise SystemExit(f"bench_train: --vary {both[0]} is also set after `--`, which would override every varied "
                         "value: set it in one place")
    for vary in combinations:
        if not vary:
            continue
        try:
            load_job_config(["--job.config_file", config, "--model.name", "qwen3_moe", *vary_overrides(vary), *extra],
                            world_size=nproc)
        except ConfigError as e:
            raise SystemExit(f"bench_train: --vary {' '.join(f'{k}={v}' for k, v in vary)}: {e}") from None


def loss_steps(result: dict) -> list[int]:
    """The step of each of a result's losses (results written before "loss_steps" logged every step)."""
    return result.get("loss_steps") or list(range(1, len(result["losses"]) + 1))


def loss_gap(base: list[float], other: list[float]) -> tuple[int, float, float]:
    """Over the logged steps both ran: (how many, other / base - 1 at the last one, the same for the
    sums of the last LOSS_WINDOW logged steps)."""
    n = min(len(base), len(other))
    w = min(LOSS_WINDOW, n)
    return n, other[n - 1] / base[n - 1] - 1, sum(other[n - w : n]) / sum(base[n - w : n]) - 1


def loss_agreement(variants: list[Variant], results: dict[str, dict]) -> str:
    """Compiled against eager, per model and router that ran both ways: relative loss difference."""
    lines = []
    for v in variants:
        if v.mode != "eager":
            continue
        eager, compiled = results.get(v.name, {}), results.get(dataclasses.replace(v, mode="compiled").name, {})
        if "losses" not in eager or "losses" not in compiled:
            continue
        n, last, window = loss_gap(eager["losses"], compiled["losses"])
        lines.append(f"| {v.name.replace(' eager', '')} | {loss_steps(eager)[n - 1]} | {eager['losses'][n - 1]:.4f} | "
                     f"{compiled['losses'][n - 1]:.4f} | {last:+.2%} | {window:+.2%} |")
    if not lines:
        return ""
    return ("| model, router | step | eager loss | compiled loss | compiled / eager - 1 | "
            f"same, mean of the last {LOSS_WINDOW} logged steps |\n|---|---|---|---|---|---|\n" + "\n".join(lines))


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in results.items():
        if "losses" in r:
            ax.plot(loss_steps(r), r["losses"], label=name, linestyle="--" if name.startswith("torchtitan") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss, same config and tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.tools.bench_train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: the GPUs here)")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: all that run here)")
    parser.add_argument("--routers", default="learned,balanced")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--grad-accum", default="1",
                        help="comma list of micro-batches per step, e.g. 1,8 (global batch = local x processes x N)")
    parser.add_argument("--vary", action="append", default=[],
                        help="section.key=v1,v2 (repeatable): our variants once per combination, e.g. dispatch.overlap=none,chunks")
    parser.add_argument("--log-freq", type=int, default=1,
                        help="[metrics] log_freq: 1 logs every step, and each logged step reads its metrics back "
                             "to the host (about 10 syncs); pretraining runs log every 10 or more")
    parser.add_argument("--repeat", type=int, default=1,
                        help="train every variant this many times, in rounds of all variants (medians and ranges)")
    parser.add_argument("--seed", type=int, default=0,
                        help="[debug] seed of every run where the config and the overrides set none")
    parser.add_argument("--gpu-power", action="store_true",
                        help="sample the GPUs' power, SM clock, temperature and clock-limit reasons (nvidia-smi) through each run")
    parser.add_argument("--profile", action="store_true", help="add each variant's step-time breakdown")
    parser.add_argument("--out", default="outputs/bench_train")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: the tables of the runs already in --out, from the same arguments "
                             "(a bench stopped before it wrote them)")
    parser.add_argument("--resume", action="store_true",
                        help="train only the runs not finished in --out, from the same arguments (a bench a time "
                             "limit stopped goes on where it stopped)")
    args = parser.parse_args(argv)
    args.extra = extra
    if args.report and args.resume:
        parser.error("--report trains nothing, --resume trains what is missing: pass one of them")
    try:
        args.grad_accum = [int(n) for n in args.grad_accum.split(",")]
    except ValueError:
        args.grad_accum = [0]
    if min(args.grad_accum) < 1:
        parser.error(f"--grad-accum {','.join(map(str, args.grad_accum))}: expected a comma list of integers >= 1")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be >= 1")
    if args.log_freq < 1 or args.steps // args.log_freq * args.log_freq <= args.warmup:
        parser.error(f"--log-freq {args.log_freq}: must be >= 1 and log a step after --warmup {args.warmup} "
                     f"within --steps {args.steps}")
    for key, allowed in (("routers", ROUTERS), ("modes", MODES), ("models", MODELS)):
        value = getattr(args, key)
        if value is not None and not set(value.split(",")) <= set(allowed):
            parser.error(f"--{key} {value}: expected a comma list of {', '.join(allowed)}")
    return args


def config_value(config: str, extra: list[str], key: str, default):
    """`section.key` as the run will see it, of `default`'s type: the overrides first, then the TOML."""
    from torchtitan_moe.train.job_config import cli_value, read_toml

    value = cli_value(extra, key)
    if value is not None:
        return type(default)(value)
    section, name = key.split(".")
    return read_toml(config).get(section, {}).get(name, default)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    nproc = args.nproc or max(torch.cuda.device_count(), 1)
    ep = config_value(args.config, args.extra, "parallelism.expert_parallel_degree", 1)
    local_batch = config_value(args.config, args.extra, "training.local_batch_size", 8)  # torchtitan's default
    seq_len = config_value(args.config, args.extra, "training.seq_len", 2048)  # torchtitan's default
    seed = config_value(args.config, args.extra, "debug.seed", args.seed)
    param_dtype = config_value(args.config, args.extra, "training.mixed_precision_param", "bfloat16")  # torchtitan's
    models = args.models.split(",") if args.models else available_models(ep, param_dtype)
    devices = gpu_power.run_devices(nproc) if args.gpu_power else []  # the GPUs the runs use: before anything trains
    if args.gpu_power and not args.report:
        gpu_power.nvidia_smi()
    combinations = vary_combinations(args.vary)
    check_combinations(args.config, args.extra, combinations, nproc)
    variants = [Variant(m, r, mode, n, vary if m != "torchtitan" else ())
                for n in args.grad_accum for m in models for r in args.routers.split(",")
                for mode in args.modes.split(",") for vary in (combinations if m != "torchtitan" else [()])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    failed: dict[str, dict] = {}
    resumed = 0
    for round_ in range(1, args.repeat + 1):
        for i, v in enumerate(variants if round_ % 2 else variants[::-1], 1):
            if v.name in failed:
                continue
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", v.name) + (f"_run{round_}" if args.repeat > 1 else "")
            dump, log, samples = out / slug, out / f"{slug}.log", out / f"{slug}.gpus.csv"
            if args.report:  # the run is in --out already (or failed there)
                code = 0
            elif args.resume and finished(dump):
                code = 0
                resumed += 1
                print(f"bench_train [{i}/{len(variants)}] {v.name}: round {round_}'s run is in {dump} (--resume)",
                      flush=True)
            else:
                (dump / "metrics.jsonl").unlink(missing_ok=True)
                again = f", round {round_} of {args.repeat}" if args.repeat > 1 else ""
                print(f"bench_train [{i}/{len(variants)}] {v.name}: {args.steps} steps on {nproc} processes{again}",
                      flush=True)
                overrides = [*v.overrides(), *v.global_batch(v.value("training.local_batch_size", local_batch), nproc),
                             "--training.steps", str(args.steps),
                             "--metrics.log_freq", str(args.log_freq), "--debug.seed", str(seed),
                             *(profiling_overrides(args.steps) if args.profile else []), *args.extra]
                (dump / FINISHED).unlink(missing_ok=True)
                with gpu_power.GPUSampler(samples) if args.gpu_power else contextlib.nullcontext():
                    code = run_training(args.config, dump, overrides, nproc, log)
                if code == 0 and dump.is_dir():
                    (dump / FINISHED).write_text("")
            if args.report and not (dump / "metrics.jsonl").exists():
                failed[v.name] = {"failed": f"no run in {dump}"}
                print(f"  {v.name}: no run in {dump}", flush=True)
                continue
            if code != 0 or not (dump / "metrics.jsonl").exists():
                failed[v.name] = {"failed": f"exit {code}, {log}"}
                print(f"  failed (exit {code}):\n{log_tail(log, 8)}", flush=True)
                continue
            run = summarize(read_metrics(dump), args.warmup, PROFILED_STEPS + 1 if args.profile else 0)
            batch = v.value("training.local_batch_size", local_batch)
            run["tokens_per_step"] = batch * v.value("training.seq_len", seq_len) * nproc * v.accum
            print(f"  {run['tps']:,.0f} tokens/s/GPU", flush=True)
            if args.gpu_power:
                run["gpus"] = gpus_during(samples, run, devices)
                if run["gpus"]:
                    run["tokens_per_joule"] = tokens_per_joule(run["tps"], run["gpus"])
            if args.profile:
                run["profile"] = profile_of(dump, args.steps)
            runs[v.name].append(run)
    results = {name: failed.get(name) or combine_runs(done) for name, done in runs.items()}

    report = table(variants, results)
    agreement = loss_agreement(variants, results)
    gain = vary_gain(variants, results, combinations[0])
    if gain:
        report += "\n\n--vary: each combination against the first, same run:\n\n" + gain
    if agreement:
        report += "\n\ncompiled against eager, same seed and tokens:\n\n" + agreement
    if args.gpu_power:
        report += (f"\n\nthe GPUs during each run's timed steps (nvidia-smi every {gpu_power.SAMPLE_MS} ms; medians):"
                   "\n\n" + gpu_table(variants, results))
    for v in variants if args.profile else []:
        profile = results[v.name].get("profile")
        report += f"\n\n### {v.name}: step-time breakdown, rank 0, the last {PROFILED_STEPS} steps\n\n"
        report += step_profile.render(profile) if profile else "no trace was written (see its log)"
        if profile and "by_rank" in profile:
            report += "\n\nthe ranks side by side (a barrier's waiting shows on the rank that arrives first):\n\n"
            report += step_profile.compare_ranks(profile["by_rank"])
    print(report)
    untimed = f", the last {PROFILED_STEPS + 1} (profiled) left out" if args.profile else ""
    rounds = f"; {args.repeat} rounds of every variant, medians of the runs" if args.repeat > 1 else ""
    rebuilt = f"the runs in {out}, trained earlier (--report)\n" if args.report else ""
    if resumed:
        rebuilt = f"{resumed} of the runs finished earlier in {out} (--resume)\n"
    header = (rebuilt + f"config: {args.config} {' '.join(args.extra)}\n"
              f"steps: {args.steps}, medians after step {args.warmup}{untimed}, {nproc} processes{rounds}\n\n")
    (out / "bench_train.md").write_text(header + report + "\n")
    (out / "bench_train.json").write_text(json.dumps(results, indent=1))
    if importlib.util.find_spec("matplotlib"):
        plot(results, out / "bench_train.png")
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
