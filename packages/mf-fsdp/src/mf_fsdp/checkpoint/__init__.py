"""State dicts and checkpoints.

The FQN-keyed state-dict form of a model and its optimizers, crash-safe
verified DCP checkpoint folders, their record and integrity checks, and a
reader that never runs code from a file. The top layer below the entry points:
imports the engine and the optimizer side. Its ``__all__`` is the public
checkpoint API (``mf_fsdp.checkpoint.save_checkpoint``, ...). Importing it also
lines up, for the first engine built, the wrap that lets torch's DSD load a
broadcast from rank 0 into uneven DTensors (``rank0_broadcast``).
"""

import mf_fsdp.checkpoint.rank0_broadcast  # noqa: F401  (joins ENGINE_BUILT)
from mf_fsdp.checkpoint.convert import (
    checkpoint_to_full_state_dict,
    full_state_dict_to_checkpoint,
    save_full_state_dict,
)
from mf_fsdp.checkpoint.load import latest_checkpoint, load_checkpoint
from mf_fsdp.checkpoint.record import RECORD_FILE
from mf_fsdp.checkpoint.save import save_checkpoint
from mf_fsdp.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from mf_fsdp.checkpoint.verify import verify_checkpoint

__all__ = [
    "RECORD_FILE",
    "checkpoint_to_full_state_dict",
    "full_state_dict_to_checkpoint",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_full_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "verify_checkpoint",
]
