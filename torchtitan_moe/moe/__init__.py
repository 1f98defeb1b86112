"""The MoE layer and its parts: router, experts, padding policy, load balancing."""

from torchtitan_moe.moe.layer import MoE, MoEArgs
from torchtitan_moe.moe.router import Router
from torchtitan_moe.dispatch.seam import Routing

__all__ = ["MoE", "MoEArgs", "Router", "Routing"]
