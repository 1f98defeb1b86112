"""Count the values a piece of code reads back to the host (.item(), bool(t), float(t), int(t)).

On a GPU each such read is a host sync: the CPU waits for the queue to drain, then the GPU waits
for the CPU. On CPU the same code dispatches the same `aten._local_scalar_dense`, so a CPU test
catches a sync that only costs on a GPU. (`Tensor.tolist()` does not dispatch: not counted.)
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncs(HostReads):
    """HostReads, plus `Tensor.tolist()` (a host sync that does not dispatch)."""

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (setattr(self, "count", self.count + 1), self._tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
