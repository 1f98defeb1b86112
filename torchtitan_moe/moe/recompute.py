"""Is this forward a recompute? Statistics are counted, and exchanges made, once per real forward."""

from __future__ import annotations

import torch


def recomputing() -> bool:
    """True while eager activation checkpointing re-runs a forward inside the backward pass.

    Asked in code that torch.compile traces it would be a graph break, so there it is not
    asked and is False: the callers that must know (the layer's statistics, the dispatchers'
    exchange replay) run eagerly. A compiled region re-run by an eager recompute does run
    again in full; config.check_semantics refuses the one path where that would count twice.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
