"""causal_attention: causal SDPA with grouped KV heads, whose outputs a recompute can take instead of computing.

    out = causal_attention(q [B, H, S, Dh], k [B, Hkv, S, Dh], v [B, Hkv, S, Dh], scale, keeper=-1)   [B, H, S, Dh]
    forward   out, lse [B, H, S] fp32 (the log-sum-exp of each query's scores, what the backward needs)
    backward  dq, dk, dv from q, k, v, out, lse and dout: the attention's backward, no forward again

Under full recompute a block's forward runs twice, and its attention forward is the costliest part that is
not a GEMM of weights (Qwen3-30B-A3B at seq 4096: 33.6 MFLOP a token, the attention's projections 37.7 and the
experts' 75.5). A keeper (an object
with `keep(out, lse)` and `take(q) -> (out, lse) | None`, registered with `register_keeper`) is asked by each
call: in the recompute it hands back what the first forward made, and no attention forward runs again; in the
first forward it is given the outputs to hold (parallel/offload.py holds them in host memory). The keeper is
passed as an int so a compiled region can carry it into the op, which reads it at run time. Either way the op
returns the same bits: the first forward's.

On a GPU the kernels are cuDNN's (what torchtitan's SDPA wrapper picks on an H100 or H200: the same bits as
`F.scaled_dot_product_attention` under cuDNN, and its backward), on the CPU torch's flash kernel for the CPU
with the KV heads repeated (its backward sums the repeats' gradients). `out` has the layout `empty_like(q)`
gives (q made by a transpose of [B, S, H, Dh]: out transposes back to it without a copy).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ._library import custom_op

_KEEPERS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # as long as their model holds them
_NEXT = itertools.count()


def register_keeper(keeper) -> int:
    """The id to pass as `keeper` for calls whose outputs `keeper` holds (keep/take, see the module docstring);
    held weakly: the model whose attention passes the id must hold the keeper."""
    index = next(_NEXT)
    _KEEPERS[index] = keeper
    return index


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _compute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        out, lse = result[0], result[1]
        lse = lse.view(lse.shape[:3])  # [B, H, S, 1] -> [B, H, S]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), 0.0, True, scale=scale)
    return _layout_of(q, out), lse.contiguous()


def _layout_of(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t in the layout empty_like(like) has (what the fakes promise torch.compile), whatever the kernel chose."""
    layout = torch.empty_like(like)
    return t if t.stride() == layout.stride() else layout.copy_(t)


@custom_op("torchtitan_moe::causal_attention")
def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      keeper: int) -> tuple[torch.Tensor, torch.Tensor]:
    holder = _KEEPERS.get(keeper) if keeper >= 0 else None
    if holder is not None:
        kept = holder.take(q)
        if kept is not None:
            return kept
    out, lse = _compute(q, k, v, scale)
    if holder is not None:
        holder.keep(out, lse)
    return out, lse


@_causal_attention.register_fake
def _(q, k, v, scale, keeper):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    q, k, v, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


@custom_op("torchtitan_moe::causal_attention_backward")
def _causal_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        s, grad = q.shape[2], _layout_of(out, grad)  # dout in out's layout, as cuDNN's own backward gets it
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, s, s, 0.0, True, scale=scale)
    else:
        heads, groups = q.shape[1], k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, _repeat_kv(k, heads), _repeat_kv(v, heads), out, lse, 0.0, True, scale=scale)
        fold = (k.shape[0], groups, heads // groups) + tuple(k.shape[2:])  # each KV head's repeats, summed
        dk, dv = dk.reshape(fold).sum(2), dv.reshape(fold).sum(2)
    return _layout_of(q, dq), _layout_of(k, dk), _layout_of(v, dv)


@_causal_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward(ctx, grad_out: torch.Tensor, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _causal_attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None, None


_causal_attention.register_autograd(_backward, setup_context=_setup)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     keeper: int = -1) -> torch.Tensor:
    """q [B, H, S, Dh], k and v [B, Hkv, S, Dh] (H a multiple of Hkv) -> out [B, H, S, Dh]; see the module
    docstring. keeper: an id from register_keeper, or -1 (none)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"causal_attention: q [B, H, S, Dh], k and v [B, Hkv, S, Dh], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"causal_attention: the query heads ({q.shape[1]}) must be a multiple of the KV heads "
                         f"({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"causal_attention: q, k and v of one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"causal_attention: on a GPU it runs cuDNN's attention, which takes bfloat16 or float16, got "
                         f"{q.dtype} (train in bfloat16: [training] mixed_precision_param, or autocast in one process)")
    return _causal_attention(q, k, v, scale, keeper)[0]
