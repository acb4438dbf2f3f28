"""Heterogeneous memory: a rank's model state in chunks across device, host and disk under a budget.

See `colab_par.tier_options.MemoryTiers` for the options and docs/design.md for the design.
"""
