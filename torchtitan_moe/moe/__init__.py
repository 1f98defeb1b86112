"""The MoE layer and its parts: router, experts, padding policy, load balancing, their settings."""

from torchtitan_moe.moe.layer import MoE
from torchtitan_moe.moe.options import MoEArgs, RouterOptions
from torchtitan_moe.moe.router import Router
from torchtitan_moe.dispatch.seam import Routing

__all__ = ["MoE", "MoEArgs", "Router", "RouterOptions", "Routing"]
