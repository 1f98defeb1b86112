"""Count the values a piece of code reads back to the host (.item(), bool(t), float(t), int(t)).

On a GPU each such read is a host sync: the CPU waits for the queue to drain, then the GPU waits
for the CPU. On CPU the same code dispatches the same `aten._local_scalar_dense`, so a CPU test
catches a sync that only costs on a GPU. (`Tensor.tolist()` does not dispatch: not counted.)
"""

import warnings

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
    """HostReads, plus `Tensor.tolist()` (a host sync that does not dispatch). With cuda=True, for
    code on a GPU, every operation that makes the host wait for it instead, as CUDA's sync debug
    mode reports them: reads, blocking copies between host and device, synchronize calls."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.cuda = cuda
        self.syncs: list[str] = []  # with cuda=True: where each sync was called (file:line)

    def __enter__(self):
        if self.cuda:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")  # every sync, not the first of each line
            torch.cuda.set_sync_debug_mode("warn")
            return self
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (setattr(self, "count", self.count + 1), self._tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self.syncs = [f"{w.filename}:{w.lineno}" for w in self._caught if "synchronizing CUDA operation" in str(w.message)]
            self.count = len(self.syncs)
            return False
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
