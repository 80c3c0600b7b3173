"""FSDP2's interface on mf's engine: ``fully_shard(module, *, mesh=..., ...)`` applied in place.

A trainer written against PyTorch FSDP2 (torchtitan's ``parallelize``,
Accelerate) switches to mf's flat buckets by one import::

    from mf_fsdp.fsdp2 import fully_shard   # instead of torch.distributed.fsdp

Each call marks what it is given (a module, or a list of modules making one
unit) and swaps the module's class for an ``FSDPModule`` subclass, as FSDP2
does; the calls go per block, then on the root. The engine is mf's one
``MegatronFSDP`` (same buckets, hooks and collectives as ``mf_fsdp.fully_shard``),
built over the outermost marked module with every marked module inside it as a
unit, when the model is first used: ``parameters()`` / ``named_parameters()``
(the optimizer is built after wrapping, on them), ``state_dict()``,
``load_state_dict()``, a forward or an ``FSDPModule`` method. Until then the
parameters are the plain ones, so ``to_empty()`` and the model's init run on
them as usual (FSDP2 defers its own root set-up to the first forward too).
The optimizer sees parameter-shaped ``UnevenDTensor``s; state-dict keys are
the module's own.

[Note: what is honoured] Every public method of torch's ``FSDPModule`` is
either honoured through the engine or raises ``NotImplementedError`` naming
itself (``module.UNSUPPORTED``); nothing silently does nothing. Options FSDP2
has and mf cannot honour yet (``dp_mesh_dims`` over two tensor-parallel storage
dims, an int ``reshard_after_forward`` other than 1 or the shard group's size,
DTensor parameters over more than one mesh, a group of modules nested with
another unit, a ``param_dtype_override_fn`` that splits one call's parameters
over two compute dtypes) raise naming the option. torch's free functions
``register_fsdp_forward_method`` and ``share_comm_ctx`` work on these modules
through ``_get_fsdp_state`` (``torch_state``); ``load_state_dict(assign=True)``
loads the values into the engine's buffers, a meta-device model's included, and
refuses another dtype.

The package, one concept per module, each importing only those above it:

- ``torch_state.py``: the part of FSDP2's per-module state torch's free
  functions read, answered by mf;
- ``handles.py``: the handles of FSDP2's asynchronous methods (``unshard``,
  ``finalize_backward``);
- ``placement.py``: ``shard_placement_fn``'s answers, and the experts' mesh;
- ``mixed_precision.py``: torch's ``MixedPrecisionPolicy`` as the casts around
  a forward and the engine's dtypes (``param_dtype_override_fn`` included);
- ``meshes.py``: the mesh the engine runs over, from the call's mesh (or
  ``dp_mesh_dims``) and the tp mesh of the model's DTensor parameters;
- ``records.py``: what each call marked (a record on its modules) and the one
  engine built over a model at its first use;
- ``module.py``: ``FSDPModule``, the class-swap mixin with torch's methods;
- ``entry.py``: ``fully_shard`` itself and its option checks.

Invariants: the package keeps no state in module globals: each call's record
lives on the modules it marked, so two models never see each other's marks.
It builds no buckets and runs no collective itself, and must not keep a second
engine's state: everything lives in the ``MegatronFSDP``. Its public names are
``__all__``'s alone (``packages/mf-fsdp/api.txt`` records them); the modules'
own names are internal.
"""

from mf_fsdp.fsdp2.entry import fully_shard
from mf_fsdp.fsdp2.module import FSDPModule

__all__ = ["FSDPModule", "fully_shard"]
