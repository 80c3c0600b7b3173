"""The run's lifecycle: ``mf-train``'s launcher, its options and checks, locks, failures, stops.

Owns the command line and every check before a process starts (``options``,
``resume``'s ``--resume`` checks), starting the ranks (``cli``, which names the worker
module as a string and never imports it), one run per folder (``run_lock``), a
rank's exception as one line (``failures``), and every rank stopping together on a
signal, a bad loss or a failure (``stopping``). Imports every room below it; it
must not import ``rank`` or ``exports``.
"""
