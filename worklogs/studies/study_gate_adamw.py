"""A study (worklogs/2026-11-27-session9-h200x2.md): gate_logits' backward piece by piece, and AdamW's kernel by
block size and warps, on one GPU.

    python worklogs/studies/study_gate_adamw.py

The "compiled split" row shows why the split is not left to torch.compile: inductor keeps fp32 values through a
bf16 round trip it fuses (the cast's rounding is gone, so the middle and low parts come out zero: dw's error
1.6e-3 of its largest value, against 1e-5)."""
import sys
import torch
import triton

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "kernels"))
from _bench import measure_ceilings, median_us  # noqa: E402
from torchtitan_moe.ops import gate_logits  # noqa: E402
from torchtitan_moe.ops.gate import split_bf16, _blocks_sum  # noqa: E402
from torchtitan_moe.ops import adamw_triton  # noqa: E402

ceil = measure_ceilings()
print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 mm {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s")

T, D, E = 16384, 2048, 128
x = torch.randn(T, D, device="cuda").to(torch.bfloat16).requires_grad_()
w = (torch.randn(E, D, device="cuda") * 0.02).requires_grad_()
g = torch.randn(T, E, device="cuda")
out = gate_logits(x, w)
rows = []
rows.append(("bwd current (autograd)", median_us(lambda: torch.autograd.grad(out, (x, w), g, retain_graph=True))))
xd, wd = x.detach(), w.detach()
rows.append(("split g 3", median_us(lambda: split_bf16(g, 3))))
g1, g2, g3 = split_bf16(g, 3)
w1, w2, w3 = split_bf16(wd, 3)
rows.append(("split w 3", median_us(lambda: split_bf16(wd, 3))))
rows.append(("cat [g1|g1|g2]", median_us(lambda: torch.cat([g1, g1, g2], dim=1))))
A = torch.cat([g1, g1, g2], dim=1)
W = torch.cat([w1, w2, w1])
rows.append(("dx mm fp32 out", median_us(lambda: torch.mm(A, W, out_dtype=torch.float32))))
dx32 = torch.mm(A, W, out_dtype=torch.float32)
rows.append(("dx cast to bf16", median_us(lambda: dx32.to(torch.bfloat16))))
rows.append(("dx mm bf16 out", median_us(lambda: torch.mm(A, W))))
B = torch.cat([g1, g2, g3], dim=1)
rows.append(("dw mm (B.t() view) fp32 out", median_us(lambda: torch.mm(B.t(), xd, out_dtype=torch.float32))))
Bt = B.t().contiguous()
rows.append(("dw mm (Bt contiguous) fp32 out", median_us(lambda: torch.mm(Bt, xd, out_dtype=torch.float32))))
dw3 = torch.mm(Bt, xd, out_dtype=torch.float32)
rows.append(("dw blocks sum", median_us(lambda: _blocks_sum(dw3, 3, 0))))
rows.append(("fp32 dx g@w", median_us(lambda: g @ wd)))
rows.append(("fp32 dw g.t()@x.float()", median_us(lambda: g.t() @ xd.float())))


def _split_both(g):
    g1 = g.to(torch.bfloat16)
    r = g - g1.float()
    g2 = r.to(torch.bfloat16)
    g3 = (r - g2.float()).to(torch.bfloat16)
    return torch.cat([g1, g1, g2], dim=1), torch.cat([g1, g2, g3], dim=1).t().contiguous()


split_c = torch.compile(_split_both)
split_c(g)
rows.append(("compiled split -> A, Bt", median_us(lambda: split_c(g))))


def variant(g):
    A, Bt = split_c(g)
    dx = torch.mm(A, W)
    dw = _blocks_sum(torch.mm(Bt, xd, out_dtype=torch.float32), 3, 0)
    return dx, dw


rows.append(("variant: compiled split, dx bf16 out, dw Bt", median_us(lambda: variant(g))))
dx_v, dw_v = variant(g)
dx_ref = (g.double() @ wd.double())
dw_ref = g.double().t() @ xd.double()
dx_cur, dw_cur = torch.autograd.grad(out, (x, w), g, retain_graph=True)
for name, a, b in (("dx cur", dx_cur, dx_ref), ("dx var", dx_v, dx_ref), ("dw cur", dw_cur, dw_ref),
                   ("dw var", dw_v, dw_ref)):
    err = (a.double() - b).abs().max().item() / b.abs().max().item()
    print(f"{name}: max err / max {err:.2e}")
print("| gate bwd piece (T=16384) | us |\n|---|---|")
for n, t in rows:
    print(f"| {n} | {t:.1f} |")
del x, w, g, out, A, B, Bt, dx32, dw3
torch.cuda.empty_cache()

# AdamW: one expert weight of a rank (64 experts, w13) and one dense weight
print("| adamw tensor | BLOCK | warps | us | GB/s | % copy |\n|---|---|---|---|---|---|")
for shape, gdt, working in (((64, 1536, 2048), torch.bfloat16, True), ((4096, 2048), torch.float32, False),
                            ((151936 // 2, 2048), torch.float32, False)):
    n = 1
    for s in shape:
        n *= s
    p = torch.randn(n, device="cuda")
    gr = (torch.randn(n, device="cuda") * 1e-3).to(gdt)
    m = torch.zeros(n, device="cuda")
    v = torch.rand(n, device="cuda") * 1e-6
    wk = torch.empty(n, device="cuda", dtype=torch.bfloat16) if working else None
    nbytes = n * (4 * 6 + gr.element_size() + (2 if working else 0))
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (512, 4)):
        def run():
            adamw_triton.adamw_foreach_triton([p], [gr], [m], [v], 3e-4, 0.9, 0.95, 1e-8, 0.1, 1000.0, [0], None, [wk],
                                              block=block, num_warps=warps)
        t = median_us(run)
        gbs = nbytes / t / 1e3
        print(f"| {shape} {str(gdt)[6:]} grad{' +working' if working else ''} | {block} | {warps} | {t:.1f} | {gbs:.0f} | {100 * gbs / ceil['copy_GBps']:.1f} |")
    del p, gr, m, v, wk
    torch.cuda.empty_cache()
