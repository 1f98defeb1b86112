"""What one H200 sustains at its 700 W power cap: bf16 GEMM, the full Qwen3-30B-A3B's expert grouped GEMMs and
its causal attention (cuDNN), each run back to back for --seconds while nvidia-smi samples power and SM clock.
The rate over the last half of the window (the clock has settled at the cap) bounds what any training step
of this model can reach on this GPU. Cited by worklogs/2026-11-28-session26-attention-keep.md.

    PYTHONPATH=. python worklogs/studies/study_power_ceiling.py --seconds 25     # one CUDA GPU
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan_moe.tools.gpu_power import GPUSampler, during, read_samples, summarize


def sustained(fn, flops: float, seconds: float, sampler_path: Path) -> dict:
    """fn run back to back for `seconds`, timed in windows of ~0.5 s: the last half's TFLOP/s, power, clock."""
    fn()
    torch.cuda.synchronize()
    windows = []  # (start, end, calls, elapsed_s)
    begin = time.time()
    while time.time() - begin < seconds:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        wall = time.time()
        start.record()
        calls = 0
        while calls == 0 or time.time() - wall < 0.5:
            fn()
            calls += 1
        stop.record()
        stop.synchronize()
        windows.append((wall, time.time(), calls, start.elapsed_time(stop) / 1e3))
    late = windows[len(windows) // 2:]
    rate = sum(c for _, _, c, _ in late) * flops / sum(e for *_, e in late) / 1e12
    first = windows[0][2] * flops / windows[0][3] / 1e12
    stats = summarize(during(read_samples(sampler_path), late[0][0], late[-1][1]))
    gpu = next(iter(stats.values()), {})
    return {"first_TFLOPs": first, "TFLOPs": rate, "watts": gpu.get("watts"), "sm_mhz": gpu.get("sm_mhz"),
            "power_cap": gpu.get("power_cap")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=25.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(8192, 8192, **bf16), torch.randn(8192, 8192, **bf16)
    # The experts at EP 1, local batch 16: 65,536 tokens x top-8 over 128 experts, 4,096 rows each.
    experts, rows, dim, hidden = 128, 4096, 2048, 768
    x = torch.randn(experts * rows, dim, **bf16)
    w13 = torch.randn(experts, dim, 2 * hidden, **bf16)
    w2 = torch.randn(experts, hidden, dim, **bf16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    h = torch.randn(experts * rows, hidden, **bf16)
    # Attention at local batch 4 (a slice of 16): 32 query heads, 4 KV heads, head dim 128, seq 4096, causal.
    q = torch.randn(4, 32, 4096, 128, **bf16, requires_grad=True)
    k = torch.randn(4, 4, 4096, 128, **bf16, requires_grad=True)
    v = torch.randn(4, 4, 4096, 128, **bf16, requires_grad=True)
    attention_flops = 4 * 4 * 32 * 4096 * 4096 * 128 / 2  # QK and PV, causal half

    def attention_fwd_bwd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), out)

    cases = [
        ("mm 8192^3", lambda: a @ b, 2 * 8192**3),
        ("grouped_mm experts w13 (fwd)", lambda: torch._grouped_mm(x, w13, offs=offsets), 2 * x.shape[0] * dim * 2 * hidden),
        ("grouped_mm experts w2 (fwd)", lambda: torch._grouped_mm(h, w2, offs=offsets), 2 * h.shape[0] * hidden * dim),
        ("attention cuDNN fwd+bwd (causal FLOPs)", attention_fwd_bwd, 3.5 * attention_flops),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "samples.csv"
        with GPUSampler(path):
            time.sleep(1)
            results = [(name, sustained(fn, flops, args.seconds, path)) for name, fn, flops in cases]
    print(f"{torch.cuda.get_device_name()}, {args.seconds:.0f} s each, rate over the last half of the window")
    print("| work | first 0.5 s TFLOP/s | sustained TFLOP/s | W (median) | SM MHz (median) | samples at the cap |")
    print("|---|---|---|---|---|---|")
    for name, r in results:
        cap = "no samples" if r["power_cap"] is None else f"{r['power_cap']:.0%}"
        print(f"| {name} | {r['first_TFLOPs']:.0f} | {r['TFLOPs']:.0f} | {r['watts']} | {r['sm_mhz']} | {cap} |")


if __name__ == "__main__":
    main()
