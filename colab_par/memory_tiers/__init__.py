"""Heterogeneous memory: a rank's model state in chunks across device, host and disk under a budget.

chunks.py (grouping in first-use order, learnt by first_use.py) -> placement.py (tiers from the
budget and the measured warm-up; measured_placement.py measures and moves) -> stores.py (memory /
memory-mapped file per chunk and kind; chunk_stores.py holds them by chunk) -> optimizer.py
(`TieredAdamW`, the streamed step; chunk_update.py the AdamW of one chunk, held_grads.py the
gradients off the fast tier, transfers.py its GPU <-> host copies). See
`colab_par.layout.tier_options.MemoryTiers` for the options and docs/design.md ("Memory tiers") for the design.
"""
