"""The module wrapper and one training step's control flow.

``MegatronFSDP``, its per-unit hooks, when gradients are reduced, meta-device
init, the sharded parameter forms the optimizer steps, gradient norms and the
engine's own loading. Builds on ``buckets``; never imports the optimizer side
(``optim``) or ``checkpoint``: those attach themselves to the engine.
"""
