"""Exchanges kept from a forward for its recompute under activation checkpointing.

A checkpointed block runs its forward twice: in the forward pass, and again inside the
backward pass to rebuild the activations. An exchange repeated there would cost network
time and a host sync for a result we already had, so a dispatcher keeps each exchange's
result (`_keep`) while the first forward runs and hands them back in order (`_replayed`)
while the recompute runs (`_replaying`). parallelize sets `keep_exchanges` on the
dispatchers of checkpointed blocks.

The chunked schedule (moe/chunks.py) makes two dispatches and two combines per forward; it
makes them in one fixed order, so its recompute asks for the kept results in the order they
were kept (the order of `_keep` calls, which for exact buffers is at `send()`, not at start).
"""

from __future__ import annotations

from collections import deque

import torch

from torchtitan_moe.dispatch.seam import recomputing


class ReplaysExchanges:
    keep_exchanges: bool = False

    def __init__(self) -> None:
        self.keep_exchanges = False
        self._kept: deque = deque()  # this layer's exchange results, in order

    def _replaying(self) -> bool:
        return self.keep_exchanges and recomputing()

    def _keep(self, item) -> None:
        if self.keep_exchanges and torch.is_grad_enabled():
            self._kept.append(item)

    def _replayed(self):
        if not self._kept:
            raise RuntimeError(f"{type(self).__name__} replay: the recomputed forward asked for an exchange "
                               "that was not kept")
        return self._kept.popleft()

    def _first_exchange(self, chunk: int = 0) -> None:
        """Called by a dispatch's first exchange: leftovers mean a forward had no backward. Only
        at chunk 0: a later chunk of the same forward (moe/chunks.py) keeps after the earlier ones."""
        if chunk == 0:
            self._kept.clear()
