"""A study (worklogs/2026-11-28-session18-h200x2.md): the AdamW kernel's update with bf16 moments as one commit
drew its random bits (one Philox call per element, 0611479's parent) against the working tree's (one per four
elements), fp32 moments beside; kernels/bench_adamw.py's tensors (one layer, 623M parameters) with bf16
gradients and working copies, as the training step has them; one GPU.

    python worklogs/studies/study_adamw_random_bits.py [--before COMMIT]

The kernel of COMMIT is read with `git show` into a module of its own. After one step the params and working
copies of both must be equal (the update uses the unrounded moments); only the moments' random bits differ."""
import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
from _bench import measure_ceilings, median_us  # noqa: E402
from bench_adamw import HYPER, SEED, SHAPES  # noqa: E402
from torchtitan_moe.ops import adamw_triton  # noqa: E402

KERNEL = "torchtitan_moe/ops/adamw_triton.py"


def kernel_of(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:{KERNEL}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.replace("from ._triton_utils import", "from torchtitan_moe.ops._triton_utils import")
    path = Path(tempfile.mkdtemp()) / "adamw_triton_before.py"
    path.write_text(source)  # @triton.jit reads its function's source from a file
    spec = importlib.util.spec_from_file_location("adamw_triton_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensors(moments: torch.dtype):
    return ([torch.randn(s, device="cuda") for s in SHAPES],
            [(torch.randn(s, device="cuda") * 1e-3).to(torch.bfloat16) for s in SHAPES],
            [torch.zeros(s, device="cuda", dtype=moments) for s in SHAPES],
            [(torch.rand(s, device="cuda") * 1e-6).to(moments) for s in SHAPES],
            [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in SHAPES])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="0611479^", help="the commit whose kernel is 'before'")
    args = parser.parse_args()
    kernels = {"before": kernel_of(args.before), "now": adamw_triton}
    n = sum(torch.Size(s).numel() for s in SHAPES)
    copy = measure_ceilings()["copy_GBps"]
    print(f"{torch.cuda.get_device_name()}: {n / 1e6:.0f}M params, copy {copy:,.0f} GB/s\n")
    print("| moments | bytes/param | kernel | us | GB/s | % of copy |\n|---|---|---|---|---|---|")
    for moments in (torch.bfloat16, torch.float32):
        nbytes = 4 + 4 + 2 + 2 + 2 * 2 * moments.itemsize  # param read + written, grad, working copy, moments
        base = tensors(moments)
        after = {}
        for name, module in kernels.items():
            p, g, m, v, w = ([t.clone() for t in ts] for ts in base)

            def step():
                module.adamw_foreach_triton(p, g, m, v, HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"],
                                            HYPER["weight_decay"], 10, [SEED + i for i in range(len(p))], None, w)
            step()
            after[name] = [t.clone() for t in p + w]
            us = median_us(step)
            print(f"| {str(moments)[6:]} | {nbytes} | {name} | {us:,.0f} | {nbytes * n / us / 1e3:,.0f} | "
                  f"{nbytes * n / us / 1e3 / copy:.1%} |")
        assert all(torch.equal(a, b) for a, b in zip(after["before"], after["now"])), "params or working copies differ"


if __name__ == "__main__":
    main()
