"""One rank of a run: its setup, the training step, checkpoints, and the worker that runs them.

Owns the process group, mesh and sharded model (``setup``), one step's
micro-batches, validation and samples (``step``), when and how the run saves and
where it resumes (``checkpoints``), and each rank's body (``worker``, started as
``python -m mf.train.rank.worker``). The top floor: it may import every other room,
and no room imports it.
"""
