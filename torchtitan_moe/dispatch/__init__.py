"""Dispatchers: how tokens reach their experts and come back (local, all-to-all, DeepEP).

`build.build_dispatchers` picks one per MoE layer from the config; import it from there.
"""

from torchtitan_moe.dispatch.base import Dispatcher, ExpertBatch
from torchtitan_moe.dispatch.local import LocalDispatcher

__all__ = ["Dispatcher", "ExpertBatch", "LocalDispatcher"]
