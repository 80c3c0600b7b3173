"""State dicts and checkpoints.

The FQN-keyed state-dict form of a model and its optimizers, crash-safe
verified DCP checkpoint folders, their record and integrity checks, and a
reader that never runs code from a file. The top layer below the entry points:
imports the engine and the optimizer side.
"""
