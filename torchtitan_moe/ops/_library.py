"""custom_op: the ops' torch.library registration, with the host cost of a launch in mind.

    @custom_op("torchtitan_moe::gather_rows")
    def _gather_rows(x: torch.Tensor, row_slot: torch.Tensor, inv: torch.Tensor) -> torch.Tensor: ...
    _gather_rows.register_fake(fake)                                   # shapes for torch.compile
    _gather_rows.register_autograd(backward, setup_context=setup)      # as torch.library's

The same contract as `torch.library.custom_op` (schema inferred from the annotations, a fake
implementation, registered autograd; torch.compile sees one opaque node, opcheck passes), built
from its parts: `Library.define`, the function as the CPU and CUDA kernel, and at the Autograd key
an `autograd.Function` that calls the op below autograd. torch's generic wrapper adds per call an
aliasing check, argument filling, pytree passes and a generated Function that our ops do not need:
on H100 hosts (torch 2.11, kernels/bench_op_host.py) gather_rows took 163-194 us of host time forward
and 600-685 us forward + backward through it, 139-142 and 501-555 us through this registration.
The dispatch path calls about 20 such ops per MoE layer
and is host-bound (80-92% GPU idle at 8192 tokens); where a host sync drains the GPU's queue (the
all-to-all split sizes) each microsecond of host time is GPU idle time.

Not for ops that mutate an input (they need the version-counter bump torch's wrapper makes) or take
tensor lists (autograd.Function does not see tensors inside lists): those use torch.library.custom_op.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}  # kept alive: dropping one unregisters its ops


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


class CustomOp:
    """One registered op: call it like the function it was made from."""

    def __init__(self, qualname: str, fn: Callable):
        namespace, self._name = qualname.split("::")
        self._qualname = qualname
        self._lib = _library(namespace)
        self._lib.define(self._name + torch.library.infer_schema(fn, mutates_args=()))
        kernel = torch._disable_dynamo(fn)  # never traced by dynamo: it launches kernels on real tensors
        for key in ("CPU", "CUDA"):
            self._lib.impl(self._name, kernel, key)
        self._op = getattr(getattr(torch.ops, namespace), self._name).default
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        return self._op(*args)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self._qualname, fake, lib=self._lib)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """backward(ctx, *grads) -> a gradient (or None) per input; setup_context(ctx, inputs, output)."""
        op = self._op

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                with torch._C._AutoDispatchBelowAutograd():
                    output = op(*args)
                setup_context(ctx=ctx, inputs=args, output=output)
                return output

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        Function.__name__ = Function.__qualname__ = f"{self._name}_autograd"

        def autograd_kernel(*args):
            if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
                return Function.apply(*args)
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args)

        self._lib.impl(self._name, autograd_kernel, "Autograd")


def custom_op(qualname: str) -> Callable[[Callable], CustomOp]:
    """Register the decorated function as the op `qualname` ("namespace::name"); see the module docstring."""
    return lambda fn: CustomOp(qualname, fn)
