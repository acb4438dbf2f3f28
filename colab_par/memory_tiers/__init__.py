"""Heterogeneous memory: a rank's model state in chunks across device, host and disk under a budget.

chunks.py (grouping in first-use order) -> placement.py (tiers from the budget and the measured
warm-up) -> stores.py (memory / memory-mapped file per chunk and kind) -> optimizer.py
(`TieredAdamW`, the streamed step; transfers.py its GPU <-> host copies). See
`colab_par.layout.tier_options.MemoryTiers` for the options and docs/design.md ("Memory tiers") for the design.
"""
