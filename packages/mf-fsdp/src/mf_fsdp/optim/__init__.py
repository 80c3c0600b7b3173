"""The optimizer side of the engine.

Binding torch optimizers to an engine's sharded parameters, the process-wide
step hooks, eager and layout-free optimizer state, local elementwise steps and
the shape-aware optimizers (Muon, Adafactor). Imports the engine; the engine
never imports it. Its ``__all__`` is the public way to teach the engine an
optimizer: ``register_elementwise_optimizer`` and ``ELEMENTWISE_OPTIMIZERS``.
"""

from mf_fsdp.optim.shape_aware import ELEMENTWISE_OPTIMIZERS, register_elementwise_optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "register_elementwise_optimizer"]
