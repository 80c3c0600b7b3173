"""``mf-train``: a real GPT training run on mf, started with one command.

The package is cut into rooms by concern. Each room's ``__init__`` says what it
owns and what it must not import; the rooms sit on floors, and a module imports
its own room or rooms of lower floors only (rooms of one floor do not import each
other; ``tests/test_architecture.py`` checks it, type-only and function-local
imports included)::

    floor 4  rank/      one rank's run: setup, the step, checkpoints, the worker body
    floor 3  run/       the run's lifecycle: mf-train's launcher, options, --resume checks,
                        locks, failures, stopping every rank together
             exports/   the model outside mf: exports, mf-sample, a folder made locally
    floor 2  data/      what a run trains on: documents, byte text, a folder's tokens, cp shards
             reports/   what a user sees and keeps: progress, metrics, TensorBoard, profiles
             adapters/  LoRA on a folder's model, and the model a --model PATH run trains
    floor 1  sources/   where the model comes from: a transformers folder, its weights, NF4 bases
    floor 0  settings   TrainOptions, the record every room reads

The rank's body is the top floor and the launcher one below it: ``mf-train``
(``run/cli.py``) starts ``python -m mf.train.rank.worker`` by name and never imports
it, while every rank uses the lifecycle's options, locks, failure reports and stops.
"""

from mf.train.run.options import parse_options
from mf.train.settings import TrainOptions

__all__ = ["TrainOptions", "parse_options"]
