"""LoRA on a transformers folder's model, and the model a ``--model PATH`` run trains.

Owns the checks of ``--lora-rank`` and ``--base-dtype nf4`` (``lora_options``),
peft's adapters under mf's sharding (``lora``), and ``run_module``: the folder's
model on the meta device with its adapters, NF4 bases or float8 linears, and its
optimizers, which the rank wraps and ``--resume`` verifies against. Imports
``settings`` and ``sources`` only; it must not import data, reports, exports, run
or rank.
"""
