"""Loss / grad-norm parity across settings, from one seed checkpoint and the same data.

    python -m torchtitan_moe.tools.parity CONFIG --vary parallelism.expert_parallel_degree=1,2,4 \\
        [--vary other.key=a,b] [--steps 20] [--nproc N] [--loss-rtol 1e-5] [--grad-rtol 1e-5] \\
        [--seed checkpoint|init] [--deterministic] [--one-launch] [--out DIR] [-- --section.key value ...]
    python -m torchtitan_moe.tools.parity CONFIG --against torchtitan [--steps 200] [-- overrides]

1. One process writes a seed checkpoint (step 0) of the model, kept under --out in a folder
   named by a hash of the model args and the seed (`seed-<key>`, with `model_args.json`): a
   seed made for another model is never reused.
2. Each setting (the product of the --vary lists) trains `--steps` steps on `--nproc`
   processes, loading that seed (`checkpoint.initial_load_path`, `load_only`): the same
   weights and, with the same process count, the same data on every rank. `--one-launch` trains
   them all in one torchrun launch (torchtitan_moe.tools.train_runs): start-up paid once, not per
   setting. With `--seed init` there is no checkpoint: every setting initializes from
   `[debug] seed` (our init is a single process's on the same device type, whatever the mesh)
   and writes a fingerprint of its starting weights, which must equal the first setting's.
3. A per-step table of loss, grad norm, aux loss and expert load, the max relative
   differences to the first setting (over the run, and by window of 25 steps: a setting equal
   to the first in maths shows the run-to-run spread to read the others against), a PNG plot
   and `parity.md` go to --out; the exit status is 1 when a difference is outside the tolerance.

`--against torchtitan` trains torchtitan 0.2.2's own Qwen3-MoE from our init (`[model] init_from`)
and ours switched to its behaviour (AS_TORCHTITAN): loss within 1% and grad norm within 5% at
every step; torchtitan trained again shows its own run-to-run spread. Then each difference is switched back on alone, then ours as configured, then
torchtitan from its own init: a table of losses at step 30 and at the end attributes the gap.

Doubled or halved gradients under expert parallelism (a known failure of EP stacks) show up
as a grad-norm ratio of 2 from step 1. Settings whose losses equal the first setting's to the
bit are marked `=`. `--deterministic` runs everything with torch's deterministic algorithms
([debug] deterministic, warn-only for ops that have none) and trains the first setting twice:
the repeat must match it bitwise (losses and grad norms), or the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_moe.tools.parity_report import (
    Comparison,
    attribution,
    compare,
    first_difference,
    fingerprint_difference,
    plot,
    read_fingerprint,
    read_metrics,
    repeat_is_bitwise,
    table,
)


@dataclass
class Setting:
    name: str  # e.g. "ep=2"
    values: list[tuple[str, str]]  # e.g. [("parallelism.expert_parallel_degree", "2")]
    checked: bool = True  # False: shown for attribution, outside the verdict
    same_init: bool = True  # must start from the first setting's weights (--seed init)

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.+-]+", "_", self.name.replace("=", "")).strip("_")

    @property
    def overrides(self) -> list[str]:
        return [arg for key, value in self.values for arg in override(key, value)]


def settings_from(varies: list[str]) -> list[Setting]:
    """["a.b=1,2", "c.d=x,y"] -> the product of the values, in order."""
    axes = []
    for vary in varies:
        key, sep, values = vary.partition("=")
        if not sep or "." not in key or not values:
            raise SystemExit(f"--vary {vary!r}: expected section.key=value1,value2,...")
        axes.append([(key, v) for v in values.split(",")])
    result = []
    for combo in itertools.product(*axes):
        short = ",".join(f"{k.split('.')[-1].replace('expert_parallel_degree', 'ep')}={v}" for k, v in combo)
        result.append(Setting(short, list(combo)))
    return result


# Our model with torchtitan 0.2.2's Qwen3-MoE behaviour, where the two differ in more than rounding.
AS_TORCHTITAN = {
    "router.bias_update_rate": "0",  # its expert bias is never updated
    "router.gate_precision": "param",  # its gate is a bf16 matrix product
    "kernels.backend": "torch",  # its loss: cross-entropy over fp32 logits (ours fuses it over bf16 logits)
    "router.balance_loss": "none",  # it has no balance loss ...
    "router.balance_loss_coeff": "0",
    "router.z_loss_coeff": "0",  # ... and no z-loss
}


ROUNDING_CONTROL = "torchtitan, 2 micro-batches"


def against_torchtitan(config: str, extra: list[str], nproc: int = 1) -> list[Setting]:
    """torchtitan's Qwen3-MoE from our init; ours switched to its behaviour (the parity check);
    torchtitan again (its run-to-run spread) and torchtitan on the same tokens in 2 micro-batches
    (ROUNDING_CONTROL: the same mathematics rounded otherwise, how far a rounding-level difference
    grows over the run); then each difference switched back to the config's value alone, ours as
    configured, and torchtitan from its own init (the attribution of the gap between the two models).
    `nproc`: the processes of each run (all data-parallel ranks), for the control's global batch."""
    from torchtitan_moe.train.job_config import load_job_config

    job = load_job_config(["--job.config_file", config, *extra])
    configured = {key: str(getattr(getattr(job, key.split(".")[0]), key.split(".")[1])) for key in AS_TORCHTITAN}
    differences = [
        ("+ expert-bias update", ["router.bias_update_rate"]),
        ("+ fp32 gate", ["router.gate_precision"]),
        ("+ our kernels and loss", ["kernels.backend"]),
        ("+ balance and z losses", ["router.balance_loss", "router.balance_loss_coeff", "router.z_loss_coeff"]),
    ]
    as_tt = list(AS_TORCHTITAN.items())
    torchtitan = [("model.name", "torchtitan_qwen3_moe")]
    from_ours = [*torchtitan, ("model.init_from", "qwen3_moe")]
    settings = [Setting("torchtitan", from_ours), Setting("ours as torchtitan", as_tt),
                Setting("torchtitan, again", from_ours, checked=False)]  # its own run-to-run spread
    local = job.training.local_batch_size
    if local % 2 == 0:  # the same global batch, accumulated from two halves
        settings.append(Setting(ROUNDING_CONTROL, [*from_ours, ("training.local_batch_size", str(local // 2)),
                                                   ("training.global_batch_size", str(local * nproc))], checked=False))
    switched = [(name, keys) for name, keys in differences if any(_differs(configured[k], AS_TORCHTITAN[k]) for k in keys)]
    for name, keys in switched:
        settings.append(Setting(name, [(k, configured[k] if k in keys else v) for k, v in as_tt], checked=False))
    if len(switched) > 1:  # with one, that row is ours as configured
        settings.append(Setting("ours", [(k, configured[k]) for k in AS_TORCHTITAN], checked=False))
    settings.append(Setting("torchtitan, own init", torchtitan, checked=False, same_init=False))
    return settings


def _differs(a: str, b: str) -> bool:
    try:
        return float(a) != float(b)
    except ValueError:
        return a != b


def override(key: str, value: str) -> list[str]:
    """("a.b", "2") -> ["--a.b", "2"]; booleans are flags: ("a.b", "false") -> ["--a.no-b"]."""
    if value.lower() in ("true", "false"):
        section, _, name = key.rpartition(".")
        return [f"--{key}" if value.lower() == "true" else f"--{section}.no-{name}"]
    return [f"--{key}", value]


def train_argv(config: str, dump: Path, overrides: list[str]) -> list[str]:
    return ["--job.config_file", config, "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]


def run_logged(cmd: list[str], log: Path) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def run_training(config: str, dump: Path, overrides: list[str], nproc: int, log: Path) -> int:
    """Train one setting (torchrun for nproc > 1), output in `log`; returns the exit status."""
    cmd = [sys.executable] if nproc == 1 else torchrun(nproc)
    return run_logged([*cmd, "-m", "torchtitan_moe.train", *train_argv(config, dump, overrides)], log)


def log_tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text().splitlines()[-lines:])


def launch(config: str, dump: Path, overrides: list[str], nproc: int, log: Path) -> None:
    """Train one setting; stop the harness with the log's tail if it fails."""
    code = run_training(config, dump, overrides, nproc, log)
    if code != 0:
        raise SystemExit(f"parity: run failed (exit {code}), log {log}:\n" + log_tail(log))


def launch_together(config: str, runs: list[tuple[Path, list[str], Path]], nproc: int, log: Path) -> None:
    """Train every (dump, overrides, log) in ONE torchrun launch (torchtitan_moe.tools.train_runs): the
    start-up is paid once. A failed run stops the launch and the harness, with that run's log tail."""
    plan = log.with_suffix(".json")
    plan.write_text(json.dumps([{"argv": train_argv(config, dump, overrides), "log": str(run_log)}
                                for dump, overrides, run_log in runs]))
    for _, _, run_log in runs:
        run_log.unlink(missing_ok=True)  # the runs append
    code = run_logged([*torchrun(nproc), "-m", "torchtitan_moe.tools.train_runs", str(plan)], log)
    if code != 0:
        failed = [run_log for _, _, run_log in runs if run_log.exists()][-1:] or [log]
        raise SystemExit(f"parity: one launch failed (exit {code}), log {failed[0]} (launch: {log}):\n"
                         + log_tail(failed[0]))


# MoE args that choose how the layer computes, not what its weights are.
_COMPUTE_ONLY_ARGS = ("kernels", "padding", "align")


def model_args_for(config: str, overrides: list[str]) -> dict:
    """The model args (flavor + [moe], [router], ...) and seed a run of `config` starts from."""
    from torchtitan_moe.train.job_config import load_job_config
    from torchtitan_moe.models.qwen3_moe import flavor_args

    job = load_job_config(["--job.config_file", config, *overrides])
    args = flavor_args(job.model.flavor)
    args.update_from_config(job)
    fields = dataclasses.asdict(args)
    for key in _COMPUTE_ONLY_ARGS:
        fields["moe"].pop(key)
    return {"model": job.model.name, "flavor": job.model.flavor, "seed": job.debug.seed, "args": fields}


def seed_of(config: str, overrides: list[str]) -> int | None:
    from torchtitan_moe.train.job_config import load_job_config

    return load_job_config(["--job.config_file", config, *overrides]).debug.seed


def seed_key(model_args: dict) -> str:
    return hashlib.sha256(json.dumps(model_args, sort_keys=True).encode()).hexdigest()[:12]


def seed_checkpoint(config: str, out: Path, overrides: list[str]) -> Path:
    """The seed checkpoint of the model these overrides give: written once, reused only for it."""
    model_args = model_args_for(config, overrides)
    seed_dir = out / f"seed-{seed_key(model_args)}"
    ckpt = seed_dir / "checkpoint" / "step-0"
    if not ckpt.exists():
        print(f"parity: writing the seed checkpoint to {ckpt}", flush=True)
        launch(config, seed_dir, [*overrides, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                                  "--parallelism.data_parallel_shard_degree", "1",
                                  "--parallelism.expert_parallel_degree", "1", "--dispatch.backend", "auto"],
               1, out / f"{seed_dir.name}.log")
        (seed_dir / "model_args.json").write_text(json.dumps(model_args, indent=1, sort_keys=True) + "\n")
    return ckpt


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv -> (the tool's own arguments, the training overrides after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.tools.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--vary", action="append", default=[], help="section.key=v1,v2,... (repeatable)")
    parser.add_argument("--against", choices=["torchtitan"], default=None,
                        help="torchtitan 0.2.2's Qwen3-MoE from our init against ours switched to its behaviour, "
                             "then each difference switched back (implies --seed init; tolerances 1%% and 5%%)")
    parser.add_argument("--only", action="append", default=[],
                        help="with --against: train only this setting besides the first (repeatable; e.g. to "
                             "split the runs over several sessions)")
    parser.add_argument("--seed", choices=["checkpoint", "init"], default=None,
                        help="checkpoint: every setting loads one seed checkpoint (default); init: every setting "
                             "initializes from [debug] seed on its own device layout, and the harness checks that "
                             "their weights agree (seconds, not a checkpoint of the whole model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=None, help="processes per setting (default: GPUs, else the largest EP)")
    parser.add_argument("--loss-rtol", type=float, default=None, help="default 1e-5 (--against: 0.01)")
    parser.add_argument("--grad-rtol", type=float, default=None, help="default 1e-5 (--against: 0.05)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch deterministic algorithms in every run; the first setting is trained twice "
                             "and must repeat bitwise")
    parser.add_argument("--one-launch", action="store_true",
                        help="train every setting in one torchrun launch (torchtitan_moe.tools.train_runs): process "
                             "start-up and imports paid once; the first failed setting stops the rest")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", default=None, help="default: outputs/parity/<config name>")
    args = parser.parse_args(argv)
    if bool(args.vary) == bool(args.against):
        parser.error("give --vary (settings to compare) or --against torchtitan, not both")
    if args.only and not args.against:
        parser.error("--only picks among the --against settings")
    if args.against and args.seed == "checkpoint":
        parser.error("--against torchtitan starts both models from one init: --seed checkpoint does not apply")
    args.seed = args.seed or ("init" if args.against else "checkpoint")
    args.loss_rtol = args.loss_rtol if args.loss_rtol is not None else (0.01 if args.against else 1e-5)
    args.grad_rtol = args.grad_rtol if args.grad_rtol is not None else (0.05 if args.against else 1e-5)
    args.extra = extra
    return args


def default_nproc(settings: list[Setting]) -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    eps = [int(v) for s in settings for k, v in s.values if k.endswith("expert_parallel_degree")]
    return max([2, *eps])


def rounding_spread(comparisons: list[Comparison]) -> str:
    """Ours against torchtitan next to torchtitan against itself rounded otherwise (2 micro-batches):
    how far apart two correct runs of these settings drift from rounding alone."""
    by_name = {c.name: c for c in comparisons}
    ours, control = by_name["ours as torchtitan"], by_name[ROUNDING_CONTROL]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else ("1.00x" if a == 0 else "inf")

    return (f"rounding spread: ours as torchtitan is at most {ours.loss:.2e} (loss) and {ours.grad_norm:.2e} (grad norm) "
            f"from torchtitan; torchtitan on the same tokens in 2 micro-batches {control.loss:.2e} and "
            f"{control.grad_norm:.2e}: ours / control {ratio(ours.loss, control.loss)} and "
            f"{ratio(ours.grad_norm, control.grad_norm)} (information; the verdict is the tolerance above)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = (against_torchtitan(args.config, args.extra, args.nproc or default_nproc([])) if args.against
                else settings_from(args.vary))
    if args.only:
        unknown = set(args.only) - {s.name for s in settings}
        if unknown:
            raise SystemExit(f"parity: --only {sorted(unknown)}: expected among {[s.name for s in settings[1:]]}")
        settings = [settings[0], *(s for s in settings[1:] if s.name in args.only)]
    nproc = args.nproc or default_nproc(settings)
    out = Path(args.out or Path("outputs") / "parity" / Path(args.config).stem)
    out.mkdir(parents=True, exist_ok=True)
    varied = {f"--{k}" for s in settings for k, _ in s.values} | set(args.extra[::2])
    # EP = 1 needs the local dispatcher, EP > 1 the all-to-all: let 'auto' pick per setting.
    common = [] if "--dispatch.backend" in varied else ["--dispatch.backend", "auto"]
    # Ops without a deterministic implementation only warn: the bitwise repeat is the verdict.
    common += ["--debug.deterministic", "--debug.deterministic_warn_only"] if args.deterministic else []
    # Every step is compared. torchtitan's bf16 gate ties top-k choices at init, which our
    # router-init check stops (it has no such check): warn only.
    common += ["--metrics.log_freq", "1", "--checks.router_init", "warn"] if args.against else []
    if args.seed == "init":
        common += ["--checks.init_fingerprint"]
        if seed_of(args.config, args.extra) is None:  # unseeded, every run would draw other weights
            common += ["--debug.seed", "0"]
    common += args.extra

    # Every run: (setting, dump folder); --deterministic trains the first setting again.
    jobs = [(s, out / s.folder) for s in settings] + ([(settings[0], out / "repeat")] if args.deterministic else [])

    def overrides_of(s: Setting) -> list[str]:
        start = []
        if args.seed == "checkpoint":  # written before any setting trains
            seed_ckpt = seed_checkpoint(args.config, out, [*common, *s.overrides])
            start = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt), "--checkpoint.load_only"]
        return [*common, *s.overrides, "--training.steps", str(args.steps), *start]

    planned = [(dump, overrides_of(s), out / f"{dump.name}.log") for s, dump in jobs]
    for s, dump in jobs:
        for stale in ("metrics.jsonl", "init_fingerprint.json"):
            (dump / stale).unlink(missing_ok=True)
    if args.one_launch:
        print(f"parity: {', '.join(s.name for s, _ in jobs)} in one launch of {nproc} processes, "
              f"{args.steps} steps each", flush=True)
        launch_together(args.config, planned, nproc, out / "one_launch.log")
    else:
        for (s, _), (dump, overrides, log) in zip(jobs, planned):
            print(f"parity: {s.name} on {nproc} processes, {args.steps} steps", flush=True)
            launch(args.config, dump, overrides, nproc, log)
    results = [read_metrics(dump) for _, dump in jobs]
    dumps = [dump for _, dump in jobs[: len(settings)]]
    runs = results[: len(settings)]
    names = [s.name for s in settings]
    comparisons = [compare(n, runs[0], run) for n, run in zip(names[1:], runs[1:])]
    checked = [c for c, s in zip(comparisons, settings[1:]) if s.checked]
    report = table(names, runs, comparisons, args, [s.checked for s in settings[1:]])
    starts_ok = True
    if args.seed == "init":
        base = read_fingerprint(dumps[0])
        for s, dump in zip(settings[1:], dumps[1:]):
            diff = fingerprint_difference(base, read_fingerprint(dump))
            same = diff is None
            starts_ok &= same == s.same_init
            report += (f"\n\nstart: {s.name} " + ("from the same weights as " + names[0] if same else f"from other weights ({diff})")
                       + ("" if same == s.same_init else "  <- WRONG"))
    if args.against and ROUNDING_CONTROL in names[1:] and "ours as torchtitan" in names[1:]:
        report += "\n\n" + rounding_spread(comparisons)
    if args.against:
        report += "\n\nloss of each setting (attribution of the gap; each '+' row is ours as torchtitan with one "
        report += "difference switched back to the config's value):\n\n" + attribution(names, runs)
    repeat_ok = True
    if args.deterministic:
        repeat = results[-1]
        repeat_ok = repeat_is_bitwise(runs[0], repeat)
        report += "\n\n" + (f"determinism: {names[0]} trained twice, losses and grad norms bitwise equal" if repeat_ok
                             else f"determinism: NOT DETERMINISTIC: {names[0]} trained twice differs: "
                                  + first_difference(runs[0], repeat))
    print(report)
    (out / "parity.md").write_text(f"python -m torchtitan_moe.tools.parity {' '.join(argv)}\n\n{report}\n")
    if not args.no_plot:
        plot(names, runs, out / "parity.png")
        print(f"parity: plot {out / 'parity.png'}")
    ok = starts_ok and repeat_ok and all(c.ok(args.loss_rtol, args.grad_rtol) for c in checked)
    print("parity: " + ("all settings within tolerance" if ok else "OUTSIDE TOLERANCE"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
