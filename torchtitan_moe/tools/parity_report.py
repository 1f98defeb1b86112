"""What parity reports: the runs' metrics read back, compared with the first setting, tabled and plotted.

    runs = [read_metrics(dump) for dump in dumps]          # metrics.jsonl of each run
    c    = compare(name, runs[0], run)                     # max relative differences over the steps
    table(names, runs, comparisons, args)                  # per-step markdown table, the verdicts, drift by window, speed
    plot(names, runs, path)                                # loss, grad norm, relative differences
    attribution(names, runs)                               # losses at step 30 and at the end

plus the starting-weight fingerprints (`--seed init`) and the bitwise-repeat check (`--deterministic`).
torchtitan_moe.tools.parity runs the settings and writes what these return.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

SPEED_WARMUP = 5  # steps left out of the speed summary (compilation, allocator warm-up)
WINDOW = 25  # steps per row of the drift table


def read_metrics(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@dataclass
class Comparison:
    name: str
    loss: float  # max relative difference to the baseline over steps
    grad_norm: float
    aux_loss: float | None
    load: float  # max |difference| of any expert's share of its layer's tokens
    loss_bitwise: bool

    def ok(self, loss_rtol: float, grad_rtol: float) -> bool:
        return self.loss <= loss_rtol and self.grad_norm <= grad_rtol and (self.aux_loss or 0.0) <= loss_rtol


def load_shares(record: dict) -> torch.Tensor:
    loads = torch.tensor(record["moe/tokens_per_expert"], dtype=torch.float64)
    return loads / loads.sum(dim=1, keepdim=True).clamp_min(1)


def compare(name: str, base: list[dict], other: list[dict]) -> Comparison:
    if [r["step"] for r in base] != [r["step"] for r in other]:
        raise SystemExit(f"parity: {name} logged other steps than the baseline")
    aux = [rel_diff(a["moe/aux_loss"], b["moe/aux_loss"]) for a, b in zip(base, other)
           if "moe/aux_loss" in a and "moe/aux_loss" in b]
    return Comparison(
        name=name,
        loss=max(rel_diff(a["loss"], b["loss"]) for a, b in zip(base, other)),
        grad_norm=max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(base, other)),
        aux_loss=max(aux) if aux else None,
        load=max((float((load_shares(a) - load_shares(b)).abs().max()) for a, b in zip(base, other)
                  if "moe/tokens_per_expert" in a and "moe/tokens_per_expert" in b), default=float("nan")),
        loss_bitwise=all(a["loss"] == b["loss"] for a, b in zip(base, other)),
    )


def drift(names: list[str], runs: list[list[dict]], loss_rtol: float, grad_rtol: float, width: int = WINDOW) -> str:
    """Per window of `width` steps, each setting against the first: max relative loss and grad-norm
    differences and the steps outside either tolerance. bf16 runs drift apart once a routing decision
    flips (a loss spike): where a setting equal in maths to the first is among them, its row is the
    run-to-run spread the others can be read against, window by window."""
    head = ["steps"] + [f"{n}: loss / grad norm / steps outside" for n in names[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    steps = [r["step"] for r in runs[0]]
    for lo in range(0, len(steps), width):
        cells = [f"{steps[lo]}-{steps[min(lo + width, len(steps)) - 1]}"]
        for run in runs[1:]:
            pairs = list(zip(runs[0][lo : lo + width], run[lo : lo + width]))
            loss = [rel_diff(a["loss"], b["loss"]) for a, b in pairs]
            grad = [rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in pairs]
            outside = sum(l > loss_rtol or g > grad_rtol for l, g in zip(loss, grad))
            cells.append(f"{max(loss):.2%} / {max(grad):.1%} / {outside}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _steps(run: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in run]


def repeat_is_bitwise(run: list[dict], repeat: list[dict]) -> bool:
    return _steps(run) == _steps(repeat)


def first_difference(run: list[dict], repeat: list[dict]) -> str:
    for (step, loss, grad), (_, loss2, grad2) in zip(_steps(run), _steps(repeat)):
        if (loss, grad) != (loss2, grad2):
            return f"step {step}: loss {loss!r} vs {loss2!r}, grad norm {grad!r} vs {grad2!r}"
    return f"{len(run)} vs {len(repeat)} logged steps"


def load_cv(record: dict) -> float:
    shares = load_shares(record)
    return float((shares.std(dim=1, unbiased=False) / shares.mean(dim=1)).max())


def table(names: list[str], runs: list[list[dict]], comparisons: list[Comparison], args,
          checked: list[bool] | None = None) -> str:
    """A markdown table: per step, each setting's loss and grad norm; then the summary."""
    head = ["step"] + [f"loss {n}" for n in names] + [f"grad_norm {n}" for n in names]
    has_aux = all("moe/aux_loss" in run[0] for run in runs)
    head += [f"aux {n}" for n in names] if has_aux else []
    head += [f"load cv {n}" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, base in enumerate(runs[0]):
        cells = [str(base["step"])]
        cells += [f"{run[i]['loss']:.7f}" for run in runs]
        cells += [f"{run[i]['grad_norm']:.6f}" for run in runs]
        cells += [f"{run[i]['moe/aux_loss']:.6f}" for run in runs] if has_aux else []
        cells += [f"{load_cv(run[i]):.4f}" if "moe/tokens_per_expert" in run[i] else "-" for run in runs]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"max relative difference to {names[0]} (tolerance: loss {args.loss_rtol:g}, grad norm {args.grad_rtol:g}):", ""]
    lines += ["| setting | loss | grad norm | aux loss | expert share (abs) | loss bitwise | verdict |", "|---|---|---|---|---|---|---|"]
    for c, check in zip(comparisons, checked or [True] * len(comparisons)):
        aux = "-" if c.aux_loss is None else f"{c.aux_loss:.2e}"
        verdict = ("ok" if c.ok(args.loss_rtol, args.grad_rtol) else "OUTSIDE TOLERANCE") if check else "(attribution)"
        lines.append(f"| {c.name} | {c.loss:.2e} | {c.grad_norm:.2e} | {aux} | {c.load:.2e} | "
                     f"{'=' if c.loss_bitwise else 'no'} | {verdict} |")
    if len(runs) > 1:
        lines += ["", f"by window, against {names[0]} (a setting equal to it in maths shows the run-to-run spread):", "",
                  drift(names, runs, args.loss_rtol, args.grad_rtol)]
    lines += ["", f"speed, median of steps after {SPEED_WARMUP} (bench_train is the benchmark):", "",
              "| setting | tokens/s/GPU | peak memory GiB |", "|---|---|---|"]
    for name, run in zip(names, runs):
        timed = [r["throughput(tps)"] for r in run if r["step"] > SPEED_WARMUP] or [r["throughput(tps)"] for r in run]
        lines.append(f"| {name} | {statistics.median(timed):,.0f} | {max(r['memory/max_reserved(GiB)'] for r in run):.1f} |")
    return "\n".join(lines)


def plot(names: list[str], runs: list[list[dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("parity: the plot needs matplotlib: pip install 'torchtitan-moe[plot]' (or pass --no-plot)")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    base = runs[0]
    for name, run in zip(names, runs):
        steps = [r["step"] for r in run]
        axes[0].plot(steps, [r["loss"] for r in run], label=name)
        axes[1].plot(steps, [r["grad_norm"] for r in run], label=name)
        if run is not base:
            axes[2].semilogy(steps, [max(rel_diff(a["loss"], b["loss"]), 1e-12) for a, b in zip(base, run)], label=f"loss {name}")
            axes[2].semilogy(steps, [max(rel_diff(a["grad_norm"], b["grad_norm"]), 1e-12) for a, b in zip(base, run)],
                             "--", label=f"grad norm {name}")
    axes[2].set_ylabel("1e-12 where equal")
    for ax, title in zip(axes, ["loss", "grad norm", f"relative difference to {names[0]}"]):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_fingerprint(dump: Path) -> dict[str, list[float]]:
    path = dump / "init_fingerprint.json"
    if not path.exists():
        raise SystemExit(f"parity: {path} was not written (--checks.init_fingerprint)")
    return json.loads(path.read_text())


def fingerprint_difference(base: dict, other: dict, rtol: float = 1e-9) -> str | None:
    """None where both runs started from the same weights, else the first weight that differs."""
    if set(base) != set(other):
        return f"other weights: {sorted(set(base) ^ set(other))[:4]}"
    for name in sorted(base):
        if any(rel_diff(a, b) > rtol for a, b in zip(base[name], other[name])):
            return f"{name}: sum, sum of squares {base[name]} vs {other[name]}"
    return None


def attribution(names: list[str], runs: list[list[dict]], steps: tuple[int, ...] = (30,)) -> str:
    """Loss of each setting at step 30 and at the last step, and its difference to the first's."""
    last = runs[0][-1]["step"]
    marks = [s for s in steps if s < last] + [last]
    head = ["setting"] + [f"loss @{s}" for s in marks] + [f"- {names[0]} @{s}" for s in marks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, run in zip(names, runs):
        at = {r["step"]: r["loss"] for r in run}
        base = {r["step"]: r["loss"] for r in runs[0]}
        cells = [f"{at[s]:.4f}" if s in at else "-" for s in marks]
        cells += [f"{at[s] - base[s]:+.4f}" if s in at and s in base else "-" for s in marks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
