"""What a run's user sees and keeps: progress, metrics, TensorBoard scalars, profiles.

Owns rank 0's ``Reporter`` (lines, ``metrics.jsonl``, the loss curve,
``last_checkpoint.json``: ``report``), the progress display (``progress``),
TensorBoard's event files (``tensorboard``) and ``--profile``'s traces
(``profiling``). Imports ``settings`` and ``sources`` only; it must not import data,
adapters, exports, run or rank.
"""
