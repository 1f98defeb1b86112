"""torchtitan-moe: fast Mixture-of-Experts pretraining as a torchtitan plugin."""

__version__ = "0.1.0"
