"""Parallelization above the MoE layer and the dispatchers: which dispatcher a run gets (choose.py,
from the tuned table in tuned.py) and building it into every MoE layer (build.py)."""
