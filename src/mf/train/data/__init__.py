"""What a run trains on: documents, byte text, a model folder's tokens, context-parallel shards.

Owns reading ``--data`` (``documents``), the built-in corpus with its byte tokenizer
and batches (``text``), a folder's tokenizer with packed sequences in a fixed order
(``tokenized``), instruction examples packed or padded (``examples``, ``packing``),
and each context-parallel rank's share of a batch (``sequence_shards``). Batches
are a pure function of (seed, step, rank). Imports ``settings`` and ``sources``
only; it must not import reports, adapters, exports, run or rank.
"""
