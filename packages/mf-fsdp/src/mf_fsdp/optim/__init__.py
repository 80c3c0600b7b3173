"""The optimizer side of the engine.

Binding torch optimizers to an engine's sharded parameters, the process-wide
step hooks, eager and layout-free optimizer state, local elementwise steps and
the shape-aware optimizers (Muon, Adafactor). Imports the engine; the engine
never imports it.
"""
