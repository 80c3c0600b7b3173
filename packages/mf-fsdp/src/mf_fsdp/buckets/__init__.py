"""Flat bucket storage and its collectives.

Layouts, per-parameter records, where weights and gradients live under each
ZeRO strategy, gathers and reductions. The lowest layer above ``config`` and
``distributed_index``: it knows nothing of the module wrapper, its hooks,
optimizers or checkpoints, and imports none of them.
"""
