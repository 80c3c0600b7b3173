"""Model and optimizer state dicts of a ``MegatronFSDP`` keyed by parameter FQN.

[Note: checkpoint form]
A checkpoint holds every tensor in the torch contract's form, the same for
every strategy, world size, HSDP layout and tp size: keyed by the wrapped
module's FQN (no ``module.`` prefix), with the parameter's *global* shape
(the tp-gathered shape for a tensor-parallel parameter). Each rank's value is
the sharded form the optimizer steps (``mf_dtensor.UnevenDTensor``, whose
DCP hooks publish the true boxes of its whole rows), or a plain tensor under
ZeRO-0 without TP; optimizer state tensors shaped like their parameter take
its form too, and scalars (Adam's ``step``) and the param groups' options
come along as they are. DCP reshards on load because it reads boxes, so a
checkpoint moves between strategies, world sizes and tp sizes, and into
PyTorch FSDP2 or a plain module (``dcp_to_torch_save``). Tied parameters are
stored once, under their canonical (first) name.

This module only builds and applies state dicts (no file I/O); see
``checkpoint/save.py`` and ``checkpoint/load.py`` for saving and loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mf_fsdp.engine.megatron_fsdp import MegatronFSDP, owner_of
from mf_fsdp.optim.kernel_choice import prefer_fast_kernels
from mf_fsdp.optim.optimizer import Optimizers, optimizer_list
from mf_fsdp.optim.state import localize_loaded_state, snapshot_state

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]


def _require_model(model: Any) -> MegatronFSDP:
    if not isinstance(model, MegatronFSDP):
        raise TypeError(f"model: expected a MegatronFSDP, got {type(model).__name__}")
    return model


def alias_names(model: MegatronFSDP) -> dict[str, str]:
    """Every non-canonical name of a tied parameter, mapped to its canonical name."""
    return {alias: fp.fqn for fp in model.fsdp_params for alias in fp.fqns[1:]}


def get_model_state_dict(model: MegatronFSDP) -> dict[str, torch.Tensor]:
    """The model's state dict in the checkpoint form (see [Note: checkpoint form]).

    The tensors of ``model.state_dict()`` (parameters and persistent buffers),
    without the aliases of tied parameters and without non-tensor extra state.
    The parameter values share storage with the engine's main weights, so
    ``dcp.load`` into this dict writes the weights in place (then call
    :func:`set_model_state_dict` to install them). No communication.
    """
    aliases = alias_names(_require_model(model))
    return {
        k: v
        for k, v in model.state_dict().items()
        if k not in aliases and isinstance(v, torch.Tensor)
    }


def set_model_state_dict(model: MegatronFSDP, state_dict: Mapping[str, Any]) -> None:
    """Load parameters and buffers (any layout, or full tensors), then install the weights.

    Raises:
        ValueError: for missing or unexpected keys (aliases of tied parameters may be
            present or not).
        RuntimeError: for a value whose shape differs from its parameter's.
    """
    aliases = alias_names(_require_model(model))
    expected = list(get_model_state_dict(model))
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected) and k not in aliases]
    if missing or unexpected:
        raise ValueError(
            f"state_dict: missing keys {missing!r}, unexpected keys {unexpected!r}; expected "
            "the keys of get_model_state_dict(model)"
        )
    model.load_state_dict(state_dict, strict=False)


def check_optimizer_binding(
    model: MegatronFSDP, optimizer: Optimizers
) -> list[torch.optim.Optimizer]:
    """Raise unless every parameter of the optimizer(s) is one of ``model``'s sharded parameters.

    Returns:
        The optimizers as a list.
    """
    optimizers = optimizer_list(optimizer)
    if not optimizers:
        raise ValueError("optimizer: expected a torch.optim.Optimizer or a non-empty list of them")
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {opt!r}")
        for group in opt.param_groups:
            for param in group["params"]:
                if owner_of(param) is not model or model.optimizer_param(param) is not param:
                    raise ValueError(
                        "optimizer: it does not step this model's sharded parameters; pass it "
                        "through mf_fsdp.fully_shard_optimizer(optimizer, model) (or "
                        "fully_shard), or build it on model.parameters() after wrapping"
                    )
    return optimizers


def _fqn_by_param(model: MegatronFSDP) -> dict[int, str]:
    return {id(fp.sharded): fp.fqn for fp in model.fsdp_params}


def _groups(optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Every param group of the optimizers, in order (as one optimizer's list)."""
    return [group for opt in optimizers for group in opt.param_groups]


def group_fqns(model: MegatronFSDP, optimizer: Optimizers) -> list[list[str]]:
    """The FQNs of each param group of the optimizer(s), in order."""
    names = _fqn_by_param(model)
    groups = _groups(optimizer_list(optimizer))
    return [[names[id(p)] for p in group["params"]] for group in groups]


def get_optimizer_state_dict(model: MegatronFSDP, optimizer: Optimizers) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN (see [Note: checkpoint form]).

    Several optimizers of one model (a list or tuple) give one state dict, as
    torch's ``get_optimizer_state_dict`` does: their states by FQN together and
    their param groups one after the other.

    Returns:
        ``{"state": {fqn: {key: value}}, "param_groups": [{option: value, "params":
        [fqn, ...]}, ...]}``; the state tensors are the optimizer's own (no copy).

    Raises:
        TypeError / ValueError: if an optimizer does not step ``model``'s sharded parameters.
    """
    optimizers = check_optimizer_binding(_require_model(model), optimizer)
    names = _fqn_by_param(model)
    state = {names[id(p)]: dict(values) for opt in optimizers for p, values in opt.state.items()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
        for group, fqns in zip(_groups(optimizers), group_fqns(model, optimizers), strict=True)
    ]
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(
    model: MegatronFSDP, optimizer: Optimizers, state_dict: Mapping[str, Any]
) -> None:
    """Replace the optimizer's state and options with those of ``state_dict``; collective.

    State tensors shaped like their parameter may be in any layout (this model's
    own, another world size's via ``dcp.load``, or full tensors); each rank keeps
    its rows. Tensors are copied (the optimizer never shares storage with
    ``state_dict``); anything else is taken as it is. Several optimizers take
    the groups in order and each parameter's state goes to the one stepping it.

    Raises:
        ValueError: if the param groups or their parameters differ, or a state entry
            names an unknown parameter.
    """
    apply_optimizer_state(model, optimizer, state_dict, owned=False)


def apply_optimizer_state(
    model: MegatronFSDP,
    optimizer: Optimizers,
    state_dict: Mapping[str, Any],
    *,
    owned: bool,
) -> None:
    """:func:`set_optimizer_state_dict`; with ``owned`` the optimizer takes the tensors as they are.

    ``owned`` is for a state dict nobody else holds (a checkpoint just loaded): no copy.
    """
    optimizers = check_optimizer_binding(_require_model(model), optimizer)
    params = {fp.fqn: fp.sharded for fp in model.fsdp_params}
    saved_groups = state_dict["param_groups"]
    current = group_fqns(model, optimizers)
    saved = [list(g["params"]) for g in saved_groups]
    if [set(g) for g in saved] != [set(g) for g in current]:  # params are matched by name
        raise ValueError(
            f"state_dict['param_groups']: parameters per group {saved!r} do not match the "
            f"optimizer's {current!r}; expected the same groups in the same order"
        )
    unknown = [fqn for fqn in state_dict["state"] if not any(fqn in g for g in current)]
    if unknown:
        raise ValueError(
            f"state_dict['state']: unknown parameters {unknown!r}; expected FQNs of the "
            "optimizer's parameters"
        )
    stepping = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}
    previous = {id(opt): snapshot_state(opt) for opt in optimizers}
    for opt in optimizers:
        opt.state.clear()
    for fqn, values in state_dict["state"].items():
        stepping[id(params[fqn])].state[params[fqn]] = {
            key: value.detach().clone() if isinstance(value, torch.Tensor) and not owned else value
            for key, value in values.items()
        }
    for group, saved_group in zip(_groups(optimizers), saved_groups, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for opt in optimizers:
        localize_loaded_state(opt, previous[id(opt)])
        prefer_fast_kernels(opt)
