"""The MoE layer's non-GEMM work: Triton kernels, each with a plain-torch reference.

    index = routing_index(experts [T, K], E, align)     expert-major row layout
    xs    = gather_rows(x [T, D], index)                [N, D] rows by expert
    ab    = grouped_mm(xs, w13, index.offsets)          [N, 2I]
    h     = swiglu_prob(ab, probs [N], index.num_rows)  [N, I]
    y     = grouped_mm(h, w2, index.offsets)            [N, D]
    out   = combine(y, index)                           [T, D] sum over each token's K rows

    rank_slots, slots_per_rank = send_plan(experts, L, P)        the all-to-all dispatcher's send side:
    meta  = send_meta(row_slot, experts, probs, L)      [S, 2K]  one row per (token, rank), its slots

    loss  = linear_cross_entropy(h [N, D], weight [V, D], labels [N])   the output layer and its
            summed cross-entropy; the Triton path makes the gradients in the forward, in place
    dw32  = upcast(dw [*] bf16)                          the experts' weight gradients to fp32
    logits = gate_logits(x [T, D] bf16, w [E, D] fp32)  [T, E] the router's fp32 gate on bf16 tensor cores
    differ = copies_differ(weights fp32, copies bf16)    [n] bool: the experts' working copies checked
    squares = sum_of_squares(tensors)                    [] fp32: the gradients' norm for clipping, in one pass
    out   = causal_attention(q, k, v, scale, keeper)     [B, H, S, Dh] cuDNN's causal attention (grouped KV heads),
            whose outputs a recompute can take from a keeper instead of computing them again

Every op takes backend="triton" (default) or "torch" (the reference, autograd through
torch ops). <op>.py holds the API, the argument checks, the reference and the
`torch.library` custom op (fake implementation, registered autograd: one opaque node for
torch.compile; registered through _library.custom_op, which costs less host time per call
than torch.library.custom_op) around the kernels; <op>_triton.py the kernels and their launchers,
imported on first use, so backend="torch" works where Triton is not installed.
grouped_mm is a custom op around torch._grouped_mm (whose meta function refuses fp32);
causal_attention one around cuDNN's attention (torch's CPU flash kernel on the CPU), with its reference
(F.scaled_dot_product_attention) beside it and no backend argument. Our kernels are deterministic: no atomics,
every output element written once (cuDNN's attention backward accumulates dq with atomics). Rows past
num_rows (garbage of torch._grouped_mm) are never read. Imports only torch and triton, so the package can be
lifted into any training stack.
"""

from .combine import combine, combine_reference, combine_tokens, gather_rows, gather_rows_reference
from .attention import causal_attention, causal_attention_reference
from .copy_check import copies_differ, copies_differ_reference
from .sum_of_squares import sum_of_squares, sum_of_squares_reference
from .gate import gate_logits, gate_logits_reference
from .cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .grouped_mm import grouped_mm
from .permute import RoutingIndex, routing_index, routing_index_reference
from .send_plan import send_meta, send_meta_reference, send_plan, send_plan_reference
from .swiglu_prob import swiglu_prob, swiglu_prob_reference
from .upcast import upcast, upcast_reference, upcast_takes

__all__ = [
    "RoutingIndex",
    "grouped_mm",
    "routing_index",
    "routing_index_reference",
    "gather_rows",
    "gather_rows_reference",
    "combine",
    "combine_reference",
    "combine_tokens",
    "swiglu_prob",
    "swiglu_prob_reference",
    "send_plan",
    "send_plan_reference",
    "send_meta",
    "send_meta_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "upcast",
    "upcast_reference",
    "gate_logits",
    "gate_logits_reference",
    "upcast_takes",
    "copies_differ",
    "copies_differ_reference",
    "sum_of_squares",
    "sum_of_squares_reference",
    "causal_attention",
    "causal_attention_reference",
]
