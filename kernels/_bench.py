"""Shared by the kernel benchmarks: ceilings measured in the same run, timing, table, JSON.

    copy bandwidth  a 1 GiB device-to-device copy: bytes read + bytes written / time
    matmul rate     bf16 8192 x 8192 x 8192 on random data: 2 * 8192^3 / time

Times are medians of triton.testing.do_bench, which clears the L2 cache before every
run, so no input is served from L2 (and all but routing_index's exceed L2 anyway).
Each op is measured three ways: "triton" (the op), "eager" (its plain-torch reference)
and "compile" (torch.compile of the reference; 'n/a' and the reason where that fails).
A backward is timed alone: the forward runs once, then only autograd.grad is timed.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch._functorch.config
import triton

# The backward of a compiled baseline is timed on one kept graph (retain_graph=True), which
# compiled graphs that donate their buffers refuse.
torch._functorch.config.donated_buffer = False


def parse_args(doc: str, tokens: tuple[int, ...] = (16384, 65536)) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(tokens), help="tokens per batch (T)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args()


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def measure_ceilings() -> dict:
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = median_us(lambda: dst.copy_(src))
    del src, dst
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_us = median_us(lambda: a @ b)
    return {"copy_GBps": 2 * nbytes / copy_us / 1e3, "matmul_bf16_TFLOPs": 2 * 8192**3 / mm_us / 1e6}


def measure_or_why(make_fn) -> tuple[float | None, str]:
    """Median µs of the function make_fn() returns (after one untimed call), or None and why not."""
    try:
        fn = make_fn()
        fn()  # compiles, autotunes; errors surface here
        return median_us(fn), ""
    except Exception as e:  # a baseline that fails (torch.compile) is reported, not fatal
        lines = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {lines[0][:100] if lines else ''}"


class Bench:
    """The rows of one op's benchmark, each against the ceilings and the two baselines."""

    def __init__(self, op: str):
        if not torch.cuda.is_available():
            raise SystemExit("the kernel benchmarks need a CUDA GPU")
        self.op = op
        self.ceilings = measure_ceilings()
        self.rows: list[dict] = []

    def forward(self, case: str, nbytes: int, impls: dict, inputs: tuple) -> None:
        """Time impl(*inputs) for each impl, as in training (inputs may require grad)."""

        def timed(impl):
            return lambda: impl(*inputs)

        self._compare(case, "forward", nbytes, impls, timed)

    def backward(self, case: str, nbytes: int, impls: dict, inputs: tuple, grad: torch.Tensor) -> None:
        """Time the gradients of impl(*inputs) w.r.t. the inputs that require grad, alone."""
        wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

        def timed(impl):
            out = impl(*inputs)  # once, untimed: the graph is kept for every timed backward
            return lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True)

        self._compare(case, "backward", nbytes, impls, timed)

    def _compare(self, case: str, direction: str, nbytes: int, impls: dict, timed) -> None:
        times = {name: measure_or_why(lambda: timed(impl)) for name, impl in impls.items()}
        eager, compiled = times["eager"][0], times["compile"][0]
        for name, (us, why) in times.items():
            gbps = None if us is None else nbytes / us / 1e3
            self.rows.append({
                "op": self.op, "case": case, "pass": direction, "impl": name, "us": us, "MB": nbytes / 1e6,
                "GBps": gbps, "pct_copy": None if gbps is None else 100 * gbps / self.ceilings["copy_GBps"],
                "x_eager": None if us is None or eager is None else eager / us,
                "x_compile": None if us is None or compiled is None else compiled / us,
                "note": why,
            })
        torch.cuda.empty_cache()

    def finish(self, json_path: str | None) -> None:
        c = self.ceilings
        print(f"\n{self.op} on {torch.cuda.get_device_name()} | torch {torch.__version__}, triton {triton.__version__}")
        print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
        print("x eager / x compile: the baseline's time over this row's (> 1: this row is faster)\n")
        cols = [("case", "{}", 34), ("pass", "{}", 8), ("impl", "{}", 7), ("us", "{:.1f}", 10), ("MB", "{:.1f}", 8),
                ("GBps", "{:.0f}", 6), ("pct_copy", "{:.1f}", 8), ("x_eager", "{:.2f}", 7), ("x_compile", "{:.2f}", 9)]
        header = " ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}" for i, (name, _, w) in enumerate(cols))
        print(header + "  note\n" + "-" * len(header))
        for row in self.rows:
            cells = [
                (fmt.format(row[name]) if row[name] is not None else "n/a").rjust(w) if i > 2 else f"{row[name]:<{w}}"
                for i, (name, fmt, w) in enumerate(cols)
            ]
            print(" ".join(cells) + ("  " + row["note"] if row["note"] else ""))
        if json_path:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "python": platform.python_version()}
            with open(json_path, "w") as f:
                json.dump({"op": self.op, **meta, "ceilings": c, "rows": self.rows}, f, indent=1)
            print(f"\nwrote {json_path}")
