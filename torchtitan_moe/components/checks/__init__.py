"""Checks that stop a broken router before step 1, and monitors of training health."""

from torchtitan_moe.components.checks.router_init import Finding, run_router_init_checks

__all__ = ["Finding", "run_router_init_checks"]
