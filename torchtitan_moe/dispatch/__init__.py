"""Dispatchers: how tokens reach their experts and come back (all-to-all, DeepEP; local in seam.py).

The seam's types (Routing, ExpertBatch, the Dispatcher protocol) live in torchtitan_moe/seam.py;
`torchtitan_moe.parallel.build.build_dispatchers` picks one per MoE layer from the config.
"""
