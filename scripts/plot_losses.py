"""Loss curves of several bench_train runs in one figure, and each curve's gap to the first.

    python scripts/plot_losses.py OUT.png RUN/bench_train.json[=LABEL] ...

Every variant of every file becomes a curve, named "<variant> <LABEL>" (LABEL defaults to the
file's folder). Prints, for each curve, its loss at the last logged step and over the last 10
logged steps relative to the first curve's: repeated runs of one variant show the run-to-run spread that
a compiled-against-eager gap has to be read against.
"""

import json
import sys
from pathlib import Path

from torchtitan_moe.tools.bench_train import LOSS_WINDOW, loss_gap, loss_steps, plot


def curves(specs: list[str]) -> dict[str, dict]:
    out = {}
    for spec in specs:
        path, _, label = spec.partition("=")
        label = label or Path(path).parent.name
        for variant, result in json.loads(Path(path).read_text()).items():
            if "losses" in result:
                out[f"{variant} {label}"] = {"losses": result["losses"], "loss_steps": loss_steps(result)}
    return out


def gaps(runs: dict[str, dict]) -> str:
    (first, base), *_ = runs.items()
    lines = [f"relative to {first}:", f"| curve | step | last loss | gap | gap, mean of the last {LOSS_WINDOW} logged |",
             "|---|---|---|---|---|"]
    for name, r in runs.items():
        n, last, window = loss_gap(base["losses"], r["losses"])
        lines.append(f"| {name} | {loss_steps(r)[n - 1]} | {r['losses'][n - 1]:.4f} | {last:+.2%} | {window:+.2%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    runs = curves(argv[1:])
    if not runs:
        raise SystemExit("plot_losses: no loss curves in " + " ".join(argv[1:]))
    plot(runs, Path(argv[0]))
    print(gaps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
