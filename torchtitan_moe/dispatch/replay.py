"""Exchanges kept from a forward for its recompute under activation checkpointing.

A checkpointed block runs its forward twice: in the forward pass, and again inside the
backward pass to rebuild the activations. What the recompute does for each exchange is
`recompute` ([dispatch] recompute):

    "replay"    the first forward keeps each exchange's result (`_keep`) and the recompute
                gets them back in order (`_replayed`, while `_replaying`): no network time,
                no host sync; the received rows of every checkpointed layer are held until
                its backward (at Qwen3-30B-A3B, EP 4, local batch 2: 0.23 GiB a layer).
    "exchange"  the recompute exchanges again. A dispatcher still keeps what spares it a host
                sync (`_keep_plan`: all_to_all's split sizes, DeepEP's handle and slots; read back
                while `_recomputing`), never the rows.

parallelize sets `keep_exchanges` (and `recompute`) on the dispatchers of checkpointed blocks.

The chunked schedule (moe/chunks.py) makes two dispatches and two combines per forward; it
makes them in one fixed order, so its recompute asks for the kept results in the order they
were kept (the order of `_keep` calls, which for exact buffers is at `send()`, not at start).
"""

from __future__ import annotations

from collections import deque

import torch

from torchtitan_moe.dispatch.seam import recomputing


class ReplaysExchanges:
    keep_exchanges: bool = False  # the block is checkpointed: keep what its recompute needs
    recompute: str = "replay"  # or "exchange" ([dispatch] recompute)

    def __init__(self) -> None:
        self.keep_exchanges = False
        self.recompute = "replay"
        self._kept: deque = deque()  # this layer's kept results or plans, in order

    def _recomputing(self) -> bool:
        return self.keep_exchanges and recomputing()

    def _replaying(self) -> bool:
        """The recompute runs and gets each exchange's result from the first forward."""
        return self._recomputing() and self.recompute == "replay"

    def _keeping(self) -> bool:
        """This forward keeps its exchanges' results for a replay."""
        return self.keep_exchanges and self.recompute == "replay" and torch.is_grad_enabled()

    def _keep(self, item) -> None:
        """An exchange's result, kept for a replay."""
        if self._keeping():
            self._kept.append(item)

    def _keep_plan(self, item) -> None:
        """What an exchange's recompute needs either way (split sizes, a handle), kept in the first forward."""
        if self.keep_exchanges and torch.is_grad_enabled() and not recomputing():
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
