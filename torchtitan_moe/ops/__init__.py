"""Triton kernels for the MoE layer, each with a plain-torch reference.

Every op takes backend="triton" (default) or backend="torch". This package
imports only torch and triton so it can be lifted into any training stack.
"""

from .combine import combine, combine_reference, gather_rows, gather_rows_reference
from .permute import RoutingIndex, routing_index, routing_index_reference
from .swiglu_prob import swiglu_prob, swiglu_prob_reference

__all__ = [
    "RoutingIndex",
    "routing_index",
    "routing_index_reference",
    "gather_rows",
    "gather_rows_reference",
    "combine",
    "combine_reference",
    "swiglu_prob",
    "swiglu_prob_reference",
]
