"""A study (worklogs/2026-11-28-session18-h200x2.md): the cross-entropy rows kernel against variants that try to
read each row's second pass from L2: the second pass backwards (the first pass's tail is read first), and
persistent programs (a few per SM, one row at a time, so fewer rows are in flight), by block size; one GPU.

    python worklogs/studies/study_cross_entropy_rows.py [--tokens 16384]

Qwen3's vocabulary (151,936), bf16 logits; the kernel reads each row twice and writes it once, so its floor is
three passes at the copy rate measured in the same run. A variant with the kernel's block is bitwise equal to it
(the loss and the gradient written over the logits); other blocks sum the row in another order."""
import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from _bench import measure_ceilings, median_us  # noqa: E402
from torchtitan_moe.ops._triton_utils import round_to  # noqa: E402
from torchtitan_moe.ops.cross_entropy_triton import cross_entropy_rows_  # noqa: E402

VOCAB, IGNORE = 151936, -100
_IGNORE = tl.constexpr(IGNORE)  # jit code reads constexpr globals only


@triton.jit
def _rows_variant(logits_ptr, labels_ptr, loss_ptr, N, V: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr,
                  PERSISTENT: tl.constexpr):
    """The kernel's arithmetic (ops/cross_entropy_triton.py), its second pass optionally backwards, its rows
    optionally walked by a fixed grid."""
    NB: tl.constexpr = (V + BLOCK - 1) // BLOCK
    if PERSISTENT:
        stride = tl.num_programs(0)
    else:
        stride = N
    for r in range(tl.program_id(0), N, stride):
        x_row = logits_ptr + tl.cast(r, tl.int64) * V
        label = tl.load(labels_ptr + r)
        m = float("-inf")
        s = 0.0
        for i in range(NB):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        log_s = tl.log(s)
        counted = label != _IGNORE
        x_label = tl.load(x_row + label, mask=counted & (label >= 0) & (label < V), other=float("nan")).to(tl.float32)
        tl.store(loss_ptr + r, tl.where(counted, (m - x_label) + log_s, 0.0))
        for i in range(NB):
            if REVERSE:
                b = NB - 1 - i
            else:
                b = i
            cols = b * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            g = tl.where(counted, tl.exp((x - m) - log_s) - tl.where(cols == label, 1.0, 0.0), 0.0)
            tl.store(x_row + cols, round_to(g, logits_ptr.dtype.element_ty), mask=cols < V)


def variant(block: int, warps: int, reverse: bool, per_sm: int):
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(logits, labels):
        loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        grid = (per_sm * sms,) if per_sm else (logits.shape[0],)
        _rows_variant[grid](logits, labels, loss, logits.shape[0], V=VOCAB, BLOCK=block, REVERSE=reverse,
                            PERSISTENT=bool(per_sm), num_warps=warps)
        return loss
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    n = parser.parse_args().tokens
    copy = measure_ceilings()["copy_GBps"]
    torch.manual_seed(0)
    logits = (torch.randn(n, VOCAB, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (n,), device="cuda")
    labels[::97] = IGNORE
    grad = logits.clone()
    loss = cross_entropy_rows_(grad, labels, IGNORE)
    floor_us = 3 * logits.numel() * 2 / copy / 1e3
    variants = {"the kernel (a program a row, 8192 / 16 warps)": lambda x, y: cross_entropy_rows_(x, y, IGNORE)}
    for block, warps in ((8192, 16), (4096, 8), (2048, 8)):
        variants[f"{block} / {warps} warps, forward"] = variant(block, warps, False, 0)
        variants[f"{block} / {warps} warps, backwards"] = variant(block, warps, True, 0)
        for per_sm in (1, 2, 4):
            variants[f"{block} / {warps} warps, backwards, {per_sm} a SM"] = variant(block, warps, True, per_sm)
    print(f"{torch.cuda.get_device_name()}: [{n}, {VOCAB}] bf16; copy {copy:,.0f} GB/s; three passes {floor_us:,.0f} us\n")
    print("| variant | us | x the kernel | % of three passes | equal to the kernel |\n|---|---|---|---|---|")
    work, first = logits.clone(), None
    for name, fn in variants.items():
        out = logits.clone()
        equal = torch.equal(fn(out, labels), loss) and torch.equal(out, grad)
        us = median_us(lambda: fn(work, labels))  # overwrites `work` each time: the same bytes, other values
        first = first or us
        print(f"| {name} | {us:,.0f} | {first / us:.3f}x | {floor_us / us:.0%} | {equal} |")


if __name__ == "__main__":
    main()
