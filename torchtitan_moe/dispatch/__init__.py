"""Dispatchers: how tokens reach their experts and come back.

The seam's types (Routing, ExpertBatch, the Dispatcher protocol) and the local dispatcher live in
seam.py; all_to_all.py, deepep.py and all_gather.py move the rows between ranks;
`torchtitan_moe.parallel.build.build_dispatchers` picks one per MoE layer from the config.
"""
