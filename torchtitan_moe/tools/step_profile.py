"""Where a training step's time goes, from one rank's torch.profiler trace.

    python -m torchtitan_moe.tools.step_profile TRACE.json[.gz] [TRACE.json ...] [--top 15] [--json OUT.json]
    python -m torchtitan_moe.tools.step_profile TRACE.json[.gz] --gaps STEP [--min-us 100]

TRACE is a chrome trace as torchtitan's `[profiling]` writes it
(<dump>/<save_traces_folder>/iteration_N/rankR_trace.json; `bench_train --profile` turns it on).
For each profiled step (torch.profiler's `ProfilerStep#N` ranges; under torchtitan's Trainer
ProfilerStep#N is training step N + 1) and their mean, it prints:

  wall       the step's host-side range, ms
  GPU busy   the union of kernels, copies and memsets on every stream inside it (overlap counted once)
  GPU idle   wall - busy
  launches   kernel launches from the host
  host syncs calls that block the host until the GPU catches up (stream/device/event synchronize,
             blocking cudaMemcpy), their count and the host time spent in them

then the kernels with the most GPU time per step, each with its class (GEMM, NCCL, Triton ours, Triton
compiled, elementwise/copy, other), the GPU time per class, the compute stream's idle time (the stream
with the most kernel time: each gap between its kernels put on the other stream that ran through most of
it and that stream's kernel that ran through most of it, a DeepEP exchange or a collective the layer
waits for, or on nothing: the host or an event), the compute stream's GEMMs that started while a kernel
of another stream ran (a persistent GEMM launches one CTA per SM; those without a free SM wait for that
kernel, and a collective spinning for a late rank holds its SMs for as long) against the same GEMM
started alone, what the longest profiled step ran beyond the shortest (a logging or monitor step shows
here), and where the idle time goes: each gap in the GPU's work is put on the host op that launched the
work ending it (its outermost op on that thread and the op that launched; "after a sync" where the host
had just waited for the GPU, so the gap is its time to launch again). A step's kernels (their times,
classes and the longest step's extra) are the ones its host range launched (the trace's correlation ids;
without them, the ones that start inside it): without a host sync at the end of every step
(log_freq > 1) the GPU runs behind the host, and a step ending in syncs (a logging step) would otherwise
take the work queued before it.
GPU busy and idle are what the GPU did during the host range.

Given several traces (rank0_trace.json, rank1_trace.json, ... of one run), it breaks down the first
and then compares the ranks: wall, GPU busy and each class per rank, and the kernels whose time
differs most between them. A collective or a dispatch barrier spins on the rank that arrives first,
so one rank's extra GEMM time shows as another's waiting kernels (DeepEP's notify_dispatch, NCCL).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
HOST_OPS = ("cpu_op", "user_annotation")  # what a host thread was doing, nested by time
STEP = re.compile(r"ProfilerStep#(\d+)")


@dataclass
class Event:
    name: str
    cat: str
    start: float  # µs
    end: float
    thread: tuple = ()  # (pid, tid): a host thread's events nest; a GPU event's tid is its stream
    correlation: int | None = None  # a GPU event's and the runtime call's that launched it


class Nesting:
    """One host thread's ops nested by time: `around(t)` lists the ops running at t, outermost first."""

    def __init__(self, ops: list[Event]):
        self.ops = sorted(ops, key=lambda e: (e.start, -e.end))
        self.starts = [e.start for e in self.ops]
        self.parent, stack = [], []
        for i, e in enumerate(self.ops):
            while stack and not self.ops[stack[-1]].end >= e.end:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def around(self, t: float) -> list[Event]:
        # The last op to start by t is inside every op that started earlier and holds t: walk up.
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.ops[i].end < t:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.ops[i])
            i = self.parent[i]
        return chain[::-1]


def load(path: str | Path) -> list[Event]:
    """The complete ('X') events of a chrome trace (.json, or gzipped as the device tool brings traces back)."""
    try:
        data = Path(path).read_bytes()
        trace = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise SystemExit(f"step_profile: cannot read {path} as a chrome trace: {e}") from e
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [Event(e["name"], e.get("cat", ""), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                  (e.get("pid"), e.get("tid")), (e.get("args") or {}).get("correlation"))
            for e in raw if e.get("ph") == "X" and "ts" in e and "name" in e]


def profiled_steps(events: list[Event]) -> list[Event]:
    """The host's ProfilerStep#N ranges, in order. The trace repeats each one on the GPU timeline
    (gpu_user_annotation, first kernel to last), which would count every step twice."""
    return sorted((e for e in events if STEP.fullmatch(e.name) and e.cat != "gpu_user_annotation"),
                  key=lambda e: e.start)


def host_nesting(events: list[Event]) -> dict[tuple, Nesting]:
    """Each host thread's ops (the steps' own ranges left out), nested by time."""
    threads = defaultdict(list)
    for e in events:
        if e.cat in HOST_OPS and not STEP.fullmatch(e.name):
            threads[e.thread].append(e)
    return {thread: Nesting(ops) for thread, ops in threads.items()}

def kernel_class(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "NCCL"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "wgmma")):
        return "GEMM"
    if low.startswith("triton_"):
        return "Triton compiled"
    if name.startswith("_") and name.endswith("_kernel"):
        return "Triton ours"
    if any(k in low for k in ("elementwise", "copy", "memcpy", "memset", "fill", "reduce")):
        return "elementwise/copy"
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def breakdown(events: list[Event]) -> dict:
    """Per-step figures and the kernel totals over the profiled steps (times in ms)."""
    steps = profiled_steps(events)
    if not steps:
        raise SystemExit("step_profile: no ProfilerStep#N ranges in the trace: was it written by torch.profiler "
                         "with a schedule (torchtitan's [profiling])?")
    gpu = [e for e in events if e.cat in GPU_CATEGORIES]
    host = [e for e in events if e.cat in HOST_CATEGORIES]
    launched_by = {e.correlation: e for e in host if e.correlation is not None}  # GPU event -> its launch
    launched = launched_in_steps(steps, gpu, launched_by)
    stream = compute_stream(gpu)  # the compute stream, for its idle time and the GEMMs beside other streams
    rows, kernels, by_step = [], defaultdict(lambda: [0.0, 0]), []
    for i, step in enumerate(steps):
        inside = [(max(e.start, step.start), min(e.end, step.end)) for e in gpu if e.end > step.start and e.start < step.end]
        syncs = [e for e in host if e.name in SYNCS and step.start <= e.start < step.end]
        busy = union_length(inside) / 1e3
        wall = (step.end - step.start) / 1e3
        rows.append({
            "step": int(STEP.fullmatch(step.name).group(1)), "wall_ms": wall, "gpu_busy_ms": busy,
            "gpu_idle_ms": wall - busy, "launches": sum(e.name in LAUNCHES and step.start <= e.start < step.end for e in host),
            "host_syncs": len(syncs), "host_sync_ms": sum(e.end - e.start for e in syncs) / 1e3,
        })
        this_step = defaultdict(float)
        for e in launched[i]:
            kernels[e.name][0] += (e.end - e.start) / 1e3
            kernels[e.name][1] += 1
            this_step[e.name] += (e.end - e.start) / 1e3
        by_step.append(this_step)
    n = len(rows)
    per_step = {name: {"ms": ms / n, "calls": calls / n, "class": kernel_class(name)} for name, (ms, calls) in kernels.items()}
    classes = defaultdict(float)
    for k in per_step.values():
        classes[k["class"]] += k["ms"]
    mean = {key: statistics.mean(r[key] for r in rows) for key in rows[0] if key != "step"}
    idle = [{**dict(zip(("host_op", "launch_op", "after_sync"), key)), "ms": ms / n, "gaps": count / n}
            for key, (ms, count) in idle_by_host_op(events, steps, gpu, host, launched_by).items()]
    idle.sort(key=lambda r: -r["ms"])
    return {"steps": rows, "mean": mean, "kernels": per_step, "classes": dict(classes), "idle": idle,
            "compute_idle": compute_stream_idle(gpu, launched, stream),
            "gemms_beside": gemms_beside_other_streams(gpu, launched, stream),
            "longest_step_extra": longest_step_extra(rows, by_step)}


def launched_in_steps(steps: list[Event], gpu: list[Event], launched_by: dict[int, Event]) -> list[list[Event]]:
    """Each step's GPU events: those whose launching runtime call (same correlation id) lies in the step's
    host range, or, for an event without a correlation id or in a trace without launches, those starting in
    it. An event whose launch is missing from a trace that has launches was launched before the trace began
    (in the profiler's warm-up step: the GPU runs behind the host) and belongs to no profiled step."""
    starts = [step.start for step in steps]
    launched: list[list[Event]] = [[] for _ in steps]
    for e in gpu:
        launch = launched_by.get(e.correlation)
        if launch is None and launched_by and e.correlation is not None:
            continue
        t = launch.start if launch is not None else e.start
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t < steps[i].end:
            launched[i].append(e)
    return launched


def short_name(name: str) -> str:
    """A kernel's name without its arguments and return type: 'deep_ep::intranode::dispatch<2, 768, 8192>'."""
    return name.removeprefix("void ").replace("(anonymous namespace)", "{anonymous}").split("(")[0][:80]


def compute_stream_idle(gpu: list[Event], launched: list[list[Event]], stream: tuple | None) -> dict:
    """The compute stream (the one with the most kernel time) per step: its busy and idle time and the idle time
    by what ran on another stream through most of each gap (the stream first, then its kernel): {stream,
    busy_ms, idle_ms, beside: [{kernel, ms, gaps}]}, ms per step. A step's gaps are those before each of its
    kernels, from the end of the stream's previous kernel (the step before's last one for its first). `stream`:
    compute_stream(gpu)."""
    if stream is None or not launched:
        return {}
    mine = sorted((e for events in launched for e in events if e.thread == stream), key=lambda e: e.start)
    gaps, reach = [], None
    for e in mine:  # one stream runs its kernels in launch order: the steps' follow each other
        if reach is not None and e.start > reach:
            gaps.append((reach, e.start))
        reach = e.end if reach is None else max(reach, e.end)
    busy = union_length([(e.start, e.end) for e in mine])
    beside = defaultdict(lambda: [0.0, 0])
    for (start, end), key in zip(gaps, beside_gaps(gaps, gpu, stream)):
        beside[key][0] += end - start
        beside[key][1] += 1
    n = len(launched)
    return {"stream": stream[1], "busy_ms": busy / n / 1e3, "idle_ms": sum(e - s for s, e in gaps) / n / 1e3,
            "beside": sorted(({"kernel": k, "ms": ms / n / 1e3, "gaps": c / n} for k, (ms, c) in beside.items()),
                             key=lambda r: -r["ms"])}


NOTHING_BESIDE = "(nothing: the host, or an event)"


def beside_gaps(gaps: list[tuple[float, float]], gpu: list[Event], stream: tuple) -> list[str]:
    """What ran beside each of `stream`'s gaps (disjoint, in order): the other stream that ran through most
    of it, named by its kernel that ran through most of it, or NOTHING_BESIDE. By stream first: an exchange is
    a chain of kernels on one stream (DeepEP's notify, then its dispatch), and a collective beside it on
    another stream may outlast each link but not the chain."""
    starts = [g[0] for g in gaps]
    cover = [defaultdict(lambda: defaultdict(float)) for _ in gaps]  # gap -> stream -> kernel -> µs
    for e in gpu:
        if e.thread == stream:
            continue
        j = bisect.bisect_left(starts, e.end) - 1
        while j >= 0 and gaps[j][1] > e.start:
            cover[j][e.thread][short_name(e.name)] += min(gaps[j][1], e.end) - max(gaps[j][0], e.start)
            j -= 1
    keys = []
    for streams in cover:
        kernels = max(streams.values(), key=lambda k: sum(k.values())) if streams else None
        keys.append(max(kernels, key=kernels.get) if kernels else NOTHING_BESIDE)
    return keys


def compute_stream_gaps(events: list[Event], step: int, min_us: float) -> list[dict]:
    """The compute stream's gaps of `min_us` and more among the kernels profiled step `step` (0-based) launched,
    in order: [{at_ms (from the step's first such kernel), gap_us, after, before, beside (beside_gaps' rule),
    host_ops (the ops around the launch of `before`, outermost first)}]. Where breakdown's idle table says
    what the compute stream waited beside, this says where in the step and for which call."""
    steps = profiled_steps(events)
    if not 0 <= step < len(steps):
        raise SystemExit(f"step_profile: --gaps {step}: the trace has {len(steps)} profiled steps (0-{len(steps) - 1})")
    gpu = [e for e in events if e.cat in GPU_CATEGORIES]
    launched_by = {e.correlation: e for e in events if e.cat in HOST_CATEGORIES and e.correlation is not None}
    stream = compute_stream(gpu)
    mine = sorted((e for e in launched_in_steps(steps, gpu, launched_by)[step] if e.thread == stream),
                  key=lambda e: e.start)
    nesting = host_nesting(events)
    pairs = [(a, b) for a, b in zip(mine, mine[1:]) if b.start - a.end >= min_us]
    keys = beside_gaps([(a.end, b.start) for a, b in pairs], gpu, stream)
    rows = []
    for (a, b), key in zip(pairs, keys):
        launch = launched_by.get(b.correlation)
        chain = nesting[launch.thread].around(launch.start) if launch is not None and launch.thread in nesting else []
        rows.append({"at_ms": (a.end - mine[0].start) / 1e3, "gap_us": b.start - a.end, "after": short_name(a.name),
                     "before": short_name(b.name), "beside": key, "host_ops": [op.name for op in chain]})
    return rows


def render_gaps(rows: list[dict]) -> str:
    lines = ["| at ms | gap µs | after | before | beside | host ops around the launch of `before` |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ops = " > ".join(r["host_ops"]) if r["host_ops"] else "-"
        lines.append(f"| {r['at_ms']:.2f} | {r['gap_us']:.0f} | {abbreviate(r['after'], 40)} | {abbreviate(r['before'], 40)} | "
                     f"{abbreviate(r['beside'], 50)} | {ops[:160]} |")
    return "\n".join(lines)


def compute_stream(gpu: list[Event]) -> tuple | None:
    """The stream (its (pid, tid)) with the most kernel time."""
    time_on = defaultdict(float)
    for e in gpu:
        time_on[e.thread] += e.end - e.start
    return max(time_on, key=time_on.get) if time_on else None


def gemms_beside_other_streams(gpu: list[Event], launched: list[list[Event]], stream: tuple | None) -> list[dict]:
    """The compute stream's GEMMs that started while a kernel of another stream ran (a collective waiting
    for a late rank, a DeepEP kernel) against those that started alone, kernel by kernel: a persistent
    GEMM launches one CTA per SM, and the CTAs with no SM free wait for the other kernel to end.
    -> [{name, alone, alone_us, beside, beside_us, extra_ms, by}], extra_ms (per step) = the time of those
    started beside another kernel over the median of those started alone; `by`: the kernel most often there.
    `stream`: compute_stream(gpu)."""
    if stream is None or not launched:
        return []
    others = sorted((e for e in gpu if e.thread != stream and e.cat == "kernel"), key=lambda e: e.start)
    starts = [e.start for e in others]
    reach, furthest = float("-inf"), []  # the latest end among the kernels started so far
    for e in others:
        reach = max(reach, e.end)
        furthest.append(reach)

    def running_at(t: float) -> Event | None:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or furthest[i] <= t:
            return None
        while others[i].end <= t:  # one of those started by t still runs: the latest such
            i -= 1
        return others[i]

    times = defaultdict(lambda: ([], [], defaultdict(int)))  # name -> (alone µs, beside µs, who was beside)
    for e in (e for events in launched for e in events):
        if e.thread != stream or e.cat != "kernel" or kernel_class(e.name) != "GEMM":
            continue
        alone, beside, by = times[e.name]
        other = running_at(e.start)
        (alone if other is None else beside).append(e.end - e.start)
        if other is not None:
            by[short_name(other.name)] += 1
    rows = []
    for name, (alone, beside, by) in times.items():
        if not beside:
            continue
        median_alone = statistics.median(alone) if alone else None
        extra = sum(t - median_alone for t in beside) if alone else 0.0
        rows.append({"name": name, "alone": len(alone), "alone_us": median_alone, "beside": len(beside),
                     "beside_us": statistics.median(beside), "extra_ms": extra / len(launched) / 1e3,
                     "by": max(by, key=by.get)})
    return sorted(rows, key=lambda r: -r["extra_ms"])


def longest_step_extra(rows: list[dict], by_step: list[dict], top: int = 8) -> list[dict]:
    """The kernels that make the longest profiled step longer than the shortest one (a logging or
    monitor step, an allocator retry, a straggling rank): [{name, class, ms}], most extra time first."""
    if len(rows) < 2:
        return []
    longest = max(range(len(rows)), key=lambda i: rows[i]["wall_ms"])
    shortest = min(range(len(rows)), key=lambda i: rows[i]["wall_ms"])
    extra = {n: ms - by_step[shortest].get(n, 0.0) for n, ms in by_step[longest].items()}
    return [{"name": n, "class": kernel_class(n), "ms": ms, "steps": (rows[longest]["step"], rows[shortest]["step"])}
            for n, ms in sorted(extra.items(), key=lambda kv: -kv[1])[:top] if ms > 0]


def idle_by_host_op(events: list[Event], steps: list[Event], gpu: list[Event], host: list[Event],
                    launched_by: dict[int, Event]) -> dict:
    """{(outermost host op, launching op, after a sync): [idle µs, gaps]} over the steps: each gap in
    the union of GPU work inside a step goes to the launch of the GPU event that ends it."""
    nesting = host_nesting(events)
    sync_ends = sorted(e.end for e in host if e.name in SYNCS)
    totals = defaultdict(lambda: [0.0, 0])

    def add(key, start, end):
        totals[key][0] += (end - start) / 1e3
        totals[key][1] += 1

    for step in steps:
        reach = step.start
        for e in sorted((e for e in gpu if e.end > step.start and e.start < step.end), key=lambda e: e.start):
            if e.start > reach:
                synced = bisect.bisect_right(sync_ends, e.start) > bisect.bisect_left(sync_ends, reach)
                add((*launcher(launched_by.get(e.correlation), nesting), synced), reach, e.start)
            reach = max(reach, e.end)
        if reach < step.end:
            add(("(the step's end: no GPU work left)", "-", False), reach, step.end)
    return dict(totals)


def launcher(launch: Event | None, nesting: dict) -> tuple[str, str]:
    """(outermost op, innermost op) on the host thread around a launch, or why there is none."""
    if launch is None:
        return "(no launch in the trace)", "-"
    chain = nesting[launch.thread].around(launch.start) if launch.thread in nesting else []
    return (chain[0].name, chain[-1].name) if chain else ("(no host op around the launch)", launch.name)


def render(result: dict, top: int = 15) -> str:
    if not result["kernels"]:
        note = "no GPU activity in this trace (a CPU run?): wall is host time, busy and idle say nothing\n\n"
    else:
        note = ""
    lines = [note + "| profiler step | wall ms | GPU busy ms | GPU idle ms | idle share | launches | host syncs | host sync ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in [*result["steps"], {"step": "mean", **result["mean"]}]:
        idle = r["gpu_idle_ms"] / r["wall_ms"] if r["wall_ms"] else 0.0
        lines.append(f"| {r['step']} | {r['wall_ms']:.2f} | {r['gpu_busy_ms']:.2f} | {r['gpu_idle_ms']:.2f} | {100 * idle:.1f}% "
                     f"| {r['launches']:.0f} | {r['host_syncs']:.0f} | {r['host_sync_ms']:.2f} |")
    kernel_ms = sum(k["ms"] for k in result["kernels"].values()) or 1.0
    lines += ["", "GPU time per step by class (kernel time summed over streams):", "",
              "| class | ms per step | share |", "|---|---|---|"]
    for name, ms in sorted(result["classes"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ms:.2f} | {100 * ms / kernel_ms:.1f}% |")
    idle = result.get("compute_idle")
    if idle:
        lines += ["", f"the compute stream (stream {idle['stream']}): {idle['busy_ms']:.2f} ms busy, {idle['idle_ms']:.2f} ms "
                  "idle per step; its idle time by the other stream that ran through most of each gap (named by that stream's "
                  "kernel that ran through most of it):", "",
                  "| beside | idle ms per step | gaps per step |", "|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['ms']:.2f} | {r['gaps']:.1f} |" for r in idle["beside"][:top]]
    if result.get("gemms_beside"):
        lines += ["", "the compute stream's GEMMs started while another stream's kernel ran (a persistent GEMM's "
                  "CTAs without a free SM wait for it), against the same GEMM started alone:", "",
                  "| GEMM | alone: calls, median µs | beside: calls, median µs | extra ms per step | mostly beside |",
                  "|---|---|---|---|---|"]
        for r in result["gemms_beside"][:top]:
            alone = f"{r['alone']}, {r['alone_us']:.1f}" if r["alone"] else "0, -"
            lines.append(f"| {abbreviate(r['name'])} | {alone} | {r['beside']}, {r['beside_us']:.1f} | "
                         f"{r['extra_ms']:.2f} | {r['by'][:50]} |")
    lines += ["", f"top {top} kernels:", "", "| kernel | class | ms per step | calls per step | share |", "|---|---|---|---|---|"]
    for name, k in sorted(result["kernels"].items(), key=lambda kv: -kv[1]["ms"])[:top]:
        lines.append(f"| {name[:80]} | {k['class']} | {k['ms']:.3f} | {k['calls']:.1f} | {100 * k['ms'] / kernel_ms:.1f}% |")
    if result.get("longest_step_extra"):
        longest, shortest = result["longest_step_extra"][0]["steps"]
        lines += ["", f"what step {longest} (the longest) ran beyond step {shortest} (the shortest), by kernel:", "",
                  "| kernel | class | extra ms |", "|---|---|---|"]
        lines += [f"| {k['name'][:80]} | {k['class']} | {k['ms']:.3f} |" for k in result["longest_step_extra"]]
    if result.get("idle") and result["kernels"]:
        lines += ["", "GPU idle per step by the host op that launched the work ending each gap (outermost op on its "
                  "thread, the launching op; after a sync: the host had just waited for the GPU):", "",
                  "| host op | launching op | after a sync | idle ms per step | gaps per step |", "|---|---|---|---|---|"]
        for r in result["idle"][:top]:
            lines.append(f"| {r['host_op'][:60]} | {r['launch_op'][:50]} | {'yes' if r['after_sync'] else 'no'} | "
                         f"{r['ms']:.2f} | {r['gaps']:.1f} |")
    return "\n".join(lines)


def abbreviate(name: str, width: int = 80) -> str:
    """A long kernel name's head and tail: CUTLASS kernels differ only at the end of their mangled names."""
    return name if len(name) <= width else f"{name[:width - 28]}...{name[-25:]}"


def compare_ranks(by_rank: dict[int, dict], top: int = 8) -> str:
    """by_rank: rank -> breakdown(). Per rank: mean wall, GPU busy and GPU time per class; then the
    `top` kernels whose per-step time differs most between the ranks."""
    ranks = sorted(by_rank)
    head = "| | " + " | ".join(f"rank {r}" for r in ranks) + " |"
    lines = [head, "|---|" + "---|" * len(ranks)]
    for key, label in (("wall_ms", "wall ms"), ("gpu_busy_ms", "GPU busy ms")):
        lines.append(f"| {label} | " + " | ".join(f"{by_rank[r]['mean'][key]:.2f}" for r in ranks) + " |")
    for key, label in (("busy_ms", "compute stream busy ms"), ("idle_ms", "compute stream idle ms")):
        lines.append(f"| {label} | " + " | ".join(f"{by_rank[r].get('compute_idle', {}).get(key, 0.0):.2f}"
                                                   for r in ranks) + " |")
    lines.append("| GEMMs' extra beside other streams ms | " + " | ".join(
        f"{sum(g['extra_ms'] for g in by_rank[r].get('gemms_beside', [])):.2f}" for r in ranks) + " |")
    classes = sorted({c for r in ranks for c in by_rank[r]["classes"]}, key=lambda c: -by_rank[ranks[0]]["classes"].get(c, 0.0))
    for c in classes:
        lines.append(f"| {c} ms | " + " | ".join(f"{by_rank[r]['classes'].get(c, 0.0):.2f}" for r in ranks) + " |")
    names = {n for r in ranks for n in by_rank[r]["kernels"]}
    ms = {n: [by_rank[r]["kernels"].get(n, {}).get("ms", 0.0) for r in ranks] for n in names}
    spread = sorted(names, key=lambda n: -(max(ms[n]) - min(ms[n])))[:top]
    lines += ["", f"the {top} kernels whose time differs most between the ranks (ms per step):", "",
              "| kernel | class | " + " | ".join(f"rank {r}" for r in ranks) + " |", "|---|---|" + "---|" * len(ranks)]
    for n in spread:
        lines.append(f"| {n[:80]} | {kernel_class(n)} | " + " | ".join(f"{v:.3f}" for v in ms[n]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.tools.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="+", help="one rank's trace, or every rank's (the first is broken down)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--gaps", type=int, metavar="STEP", default=None,
                        help="instead, list the compute stream's gaps of profiled step STEP (0-based) of the first "
                             "trace, in order, with what ran beside each and the host ops of the call after it")
    parser.add_argument("--min-us", type=float, default=100.0, help="--gaps: the shortest gap listed (µs)")
    args = parser.parse_args(argv)
    if args.gaps is not None:
        print(render_gaps(compute_stream_gaps(load(args.trace[0]), args.gaps, args.min_us)))
        return 0
    results = [breakdown(load(t)) for t in args.trace]
    print(render(results[0], args.top))
    if len(results) > 1:
        print("\nthe traces side by side (rank = their order):\n\n" + compare_ranks(dict(enumerate(results))))
    if args.json:
        Path(args.json).write_text(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
