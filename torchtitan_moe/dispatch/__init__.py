"""Dispatchers: how tokens reach their experts and come back.

The seam's types (Routing, ExpertBatch, the Dispatcher protocol) and the local dispatcher live in
seam.py; all_to_all.py, deepep.py and all_gather.py move the rows between ranks; registry.py names
each once, with what it takes and how it is built; `torchtitan_moe.parallel.build.build_dispatchers`
asks it for one per MoE layer.
"""
