"""HSDP on GPUs: replication over 2 GPUs equals 1 GPU that reads both ranks' batches.

    python scripts/hsdp_gpu.py OUT [--steps 20] [--rtol 1e-4] [-- --section.key value ...]

The GPU counterpart of tests/test_hsdp.py's `replicate4`: the debug model (fp32, its default
kernels: Triton on CUDA) trains `--steps` steps as data_parallel_replicate_degree = 2 x shard 1,
EP = 1 on 2 GPUs (NCCL), and on 1 GPU reading, each step, the batches of both data-parallel ranks
side by side (tests/resume_harness.py, "data_of_ranks"). Both start from [debug] seed (our init is
one process's whatever the mesh; the fingerprints are compared). Writes OUT/hsdp.md (parity's
comparison of loss, grad norm, aux loss and loads) and exits 1 when a difference is above --rtol.
cuBLAS picks its kernels by shape, so half the batch is summed in other orders than the whole:
the default --rtol 1e-4 is a guess, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from spawn_ranks import launch_plan  # noqa: E402

from torchtitan_moe.tools import parity_report  # noqa: E402
from torchtitan_moe.tools.parity import split_overrides  # noqa: E402

COMMON = ["--router.balance_loss", "global_batch", "--router.balance_loss_coeff", "0.01", "--checks.init_fingerprint"]


def main(argv: list[str]) -> int:
    argv, extra = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "one").mkdir(parents=True, exist_ok=True)

    def run(dump: Path, *overrides: str) -> dict:
        return {"train": ["--job.dump_folder", str(dump), "--training.steps", str(args.steps), *COMMON, *extra,
                          *overrides], "log": str(dump)}

    launch_plan([run(out / "replicate2", "--parallelism.data_parallel_replicate_degree", "2")], out, nproc=2)
    launch_plan([{**run(out / "one" / "run"), "data_of_ranks": 2}], out / "one", nproc=1)
    one, two = parity_report.read_metrics(out / "one" / "run"), parity_report.read_metrics(out / "replicate2")
    start = parity_report.fingerprint_difference(parity_report.read_fingerprint(out / "one" / "run"),
                                                 parity_report.read_fingerprint(out / "replicate2"))
    c = parity_report.compare("replicate 2 x EP 1, 2 GPUs", one, two)
    report = (f"replicate 2 x EP 1 on 2 GPUs against 1 GPU reading both ranks' batches, {args.steps} steps\n\n"
              f"| | max relative difference |\n|---|---|\n| loss | {c.loss:.2e} |\n| grad norm | {c.grad_norm:.2e} |\n"
              f"| aux loss | {c.aux_loss:.2e} |\n| expert load share (abs) | {c.load:.2e} |\n\n"
              f"loss at step 1 / {args.steps}: 1 GPU {one[0]['loss']:.6f} / {one[-1]['loss']:.6f}, "
              f"2 GPUs {two[0]['loss']:.6f} / {two[-1]['loss']:.6f}\n"
              f"start: {'the same weights' if start is None else 'OTHER WEIGHTS: ' + start}\n")
    ok = start is None and c.ok(args.rtol, args.rtol)
    report += f"verdict: {'within' if ok else 'OUTSIDE'} rtol {args.rtol}\n"
    (out / "hsdp.md").write_text(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
