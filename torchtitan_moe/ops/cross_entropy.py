"""linear_cross_entropy: the output layer and its cross-entropy loss, gradients made in the forward.

    h        [N, D]  final hidden states (after the last norm)
    weight   [V, D]  the output layer, h's dtype
    labels   [N]     int64 target ids; rows labelled ignore_index count nothing
    -> loss  []      fp32: sum over rows of logsumexp(logits) - logits[label]
                     (reduction "sum", as torchtitan's loss; it divides by the token count later)

logits = h @ weight.T [N, V] in h's dtype, as an nn.Linear makes them.

torch    the reference and torchtitan's own math: F.cross_entropy of the fp32 logits, autograd.
triton   the rows in chunks of at most LOGITS_CHUNK_BYTES of logits [n, V]: one kernel reads each
         logits row twice (max and sum online in fp32, then softmax - one-hot) and overwrites it
         with its gradient G in h's dtype; then dh[rows] = G @ weight [n, D] and
         dweight += G.T @ h[rows] [V, D], accumulated over the chunks in fp32 and rounded once at
         the end. The backward only scales both by the loss's incoming gradient. Neither the
         whole [N, V] logits nor fp32 log-probabilities are ever made: at 49,152 tokens (the full
         model's local batch 12) and Qwen3's 151,936-token vocabulary the bf16 logits alone are
         15 GB, torchtitan's fp32 log-probabilities 30 GB. G is rounded before that scaling
         (torchtitan rounds after): the two differ by at most one rounding of h's dtype.
Meant for training: the Triton path runs the gradient GEMMs even where nothing requires a
gradient (evaluate from logits instead, as torchtitan's validator does).
Labels outside [0, V) other than ignore_index: the torch path raises (a device assert on CUDA);
the kernel never reads out of bounds and returns a NaN loss instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import use_triton
from ._library import custom_op

IGNORE_INDEX = -100  # torchtitan's (torchtitan.components.loss.IGNORE_INDEX)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The logits made at once: 2 GiB is 7,066 rows of Qwen3's vocabulary in bf16, large enough that the gradient
# GEMMs stay compute-bound beside the fp32 accumulator's traffic ([V, D] read and written once a chunk).
LOGITS_CHUNK_BYTES = 2 << 30


def _check_args(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if h.dim() != 2 or not h.is_floating_point():
        raise ValueError(f"h must be a float tensor [N, D], got {tuple(h.shape)} {h.dtype}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1] or weight.dtype != h.dtype:
        raise ValueError(f"weight must be [V, {h.shape[1]}] {h.dtype} like h, got {tuple(weight.shape)} {weight.dtype}")
    if labels.shape != h.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 of shape [{h.shape[0]}], got {tuple(labels.shape)} {labels.dtype}")
    if not h.device == weight.device == labels.device:
        raise ValueError(f"h, weight and labels must be on one device, got {h.device}, {weight.device}, {labels.device}")


def linear_cross_entropy_reference(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """torchtitan's loss on an nn.Linear's logits: cross-entropy of the fp32 logits, summed."""
    logits = h @ weight.t()
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


# ---------------------------------------------------------------------------- Triton op
# One opaque node for torch.compile. Its outputs after the loss are the gradients, kept for
# the backward (they do not depend on the incoming gradient, only scale with it).


@custom_op("torchtitan_moe::linear_cross_entropy")
def _linear_cross_entropy_triton(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .cross_entropy_triton import cross_entropy_rows_

    loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h)
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = h[rows] @ weight.t()  # [n, V]
        loss_rows[rows] = cross_entropy_rows_(logits, labels[rows], ignore_index)  # logits now hold G
        torch.mm(logits, weight, out=dh[rows])
        _add_product_(dweight, logits.t(), h[rows])
        del logits  # freed before the next chunk's are made
    return loss_rows.sum(), dh, dweight.to(weight.dtype)


def _add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [M, K] fp32 += a [M, n] @ b [n, K], the product summed in fp32 and never rounded to a's dtype."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # cuBLAS: 16-bit inputs, fp32 C and D
    else:  # fp32 inputs, or the CPU, which has no 16-bit GEMM with an fp32 output: the same products in fp32
        acc.addmm_(a.float(), b.float())


@_linear_cross_entropy_triton.register_fake
def _(h, weight, labels, ignore_index, chunk_rows):
    return h.new_empty((), dtype=torch.float32), torch.empty_like(h), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])
    ctx.set_materialize_grads(False)  # the gradient outputs get none: no [V, D] of zeros for them (0.2 ms)


@custom_op("torchtitan_moe::linear_cross_entropy_backward")
def _scale_gradients(dh: torch.Tensor, dweight: torch.Tensor, dloss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .cross_entropy_triton import scaled

    return scaled(dh, dloss.float()), scaled(dweight, dloss.float())


@_scale_gradients.register_fake
def _(dh, dweight, dloss):
    return torch.empty_like(dh), torch.empty_like(dweight)


def _backward(ctx, dloss, _dh, _dweight):
    dh, dweight = ctx.saved_tensors
    dh, dweight = _scale_gradients(dh, dweight, dloss)
    return dh, dweight, None, None, None


_linear_cross_entropy_triton.register_autograd(_backward, setup_context=_setup_context)


def default_chunk_rows(rows: int, vocab: int, element_size: int) -> int:
    """Rows of logits made at once: the fewest chunks whose logits fit LOGITS_CHUNK_BYTES, of equal rows (no
    small last GEMM)."""
    most = max(1, LOGITS_CHUNK_BYTES // (vocab * element_size))
    return max(1, -(-rows // max(1, -(-rows // most))))


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    *, backend: str = "triton", chunk_rows: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy [] fp32 of the logits h @ weight.T against labels. chunk_rows: rows of
    logits made at once by the Triton path (default: default_chunk_rows)."""
    _check_args(h, weight, labels)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(h.shape[0], weight.shape[0], weight.element_size())
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if not use_triton(backend, h):
        return linear_cross_entropy_reference(h, weight, labels, ignore_index)
    if h.dtype not in TRITON_DTYPES:
        raise ValueError(f"backend='triton' takes h in {', '.join(map(str, TRITON_DTYPES))}, got {h.dtype}; "
                         "use backend='torch'")
    return _linear_cross_entropy_triton(h, weight, labels, ignore_index, chunk_rows)[0]
