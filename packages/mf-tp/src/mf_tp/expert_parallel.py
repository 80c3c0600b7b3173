"""Expert parallelism for a model's own experts module: transformers' grouped-weight experts.

Responsibility: :func:`expert_parallel` turns, in place, the experts module of a
transformers 5 MoE model (``Qwen3MoeExperts``, ``MixtralExperts``, ...: grouped weights
``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``, an ``act_fn``, called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``)
into an expert-parallel one: each rank of the EP group keeps its ``E / p`` experts, as
DTensors ``Shard(0)`` over the group (parameter-shaped: state dicts hold the full
``[E, ...]``), and a call moves each token's rows to the ranks of its experts with
:func:`mf_tp.dispatch_tokens`, runs the local experts with one grouped matmul per weight
(:func:`mf_tp.grouped_experts.grouped_linear`), and brings them back weighted with
:func:`mf_tp.combine_tokens`. The model's router and everything else stay as they are; mf-fsdp
then shards the experts over the expert-data-parallel group (``expt_device_mesh``).

It must not: change what the module computes (the same function as the model's own forward,
up to the order of fp32 sums), or touch modules other than the one it is given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mf_tp.grouped_experts import RowGroups, grouped_linear
from mf_tp.moe import combine_tokens, dispatch_tokens
from mf_utils import set_expert_parallel_attribute

__all__ = ["expert_parallel"]

_WEIGHTS = ("gate_up_proj", "down_proj")
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class _ExpertParallel(nn.Module):
    """What :func:`expert_parallel` adds to an experts module's own class."""

    ep_group: dist.ProcessGroup
    gate_up_proj: DTensor
    down_proj: DTensor
    act_fn: Any

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``[T, H]`` tokens to their ``top_k`` experts, wherever they live, and back."""
        num_experts = self.gate_up_proj.shape[0]
        rows, state = dispatch_tokens(hidden_states, top_k_index, num_experts, self.ep_group)
        groups = RowGroups.of(state.tokens_per_local_expert, rows.device)
        gate_up = grouped_linear(rows, self.gate_up_proj.to_local(), None, groups)
        gate, up = gate_up.chunk(2, dim=-1)
        out = grouped_linear(self.act_fn(gate) * up, self.down_proj.to_local(), None, groups)
        return combine_tokens(out, top_k_weights.to(out.dtype), state)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        """``to``, ``to_empty`` ...: swapped DTensor parameters get the expert mark again."""
        result = super()._apply(fn, recurse)
        _mark(self)
        return result


def _mark(module: nn.Module) -> None:
    for name in _WEIGHTS:
        set_expert_parallel_attribute(module.get_parameter(name))


def expert_parallel(experts: nn.Module, ep_group: dist.ProcessGroup) -> nn.Module:
    """Spread ``experts``' grouped weights over ``ep_group`` and run them with mf-tp's dispatch.

    Call it on every rank of ``ep_group``, on the model built from the same seed (each
    rank keeps its own experts' rows of the full weights), before wrapping the model with
    mf-fsdp (``expt_device_mesh`` with the group as its expert-parallel dim).

    Args:
        experts: a transformers experts module (``gate_up_proj [E, 2F, H]``,
            ``down_proj [E, H, F]``, ``act_fn``), e.g. ``model.model.layers[i].mlp.experts``.
        ep_group: the expert-parallel group; its size must divide ``E``.

    Returns:
        ``experts`` itself, its class swapped for one that dispatches.

    Raises:
        TypeError: if ``experts`` lacks the grouped weights or ``act_fn``.
        ValueError: if the EP size does not divide the number of experts, or the
            module was made expert-parallel already.
    """
    where = f"expert_parallel({type(experts).__name__})"
    if isinstance(experts, _ExpertParallel):
        raise ValueError(f"{where}: the module is expert-parallel already")
    found = [getattr(experts, name, None) for name in _WEIGHTS]
    weights = [w for w in found if isinstance(w, nn.Parameter) and w.dim() == 3]
    if len(weights) != len(_WEIGHTS) or not hasattr(experts, "act_fn"):
        raise TypeError(
            f"{where}: expected an experts module with 3-D parameters gate_up_proj [E, 2F, H] "
            "and down_proj [E, H, F] and an act_fn (transformers 5's grouped experts)"
        )
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    num_experts = weights[0].shape[0]
    if num_experts % size != 0:
        raise ValueError(
            f"{where}: ep_group of size {size} does not divide the {num_experts} experts; "
            "every EP rank must own the same number"
        )
    local = num_experts // size
    mesh = DeviceMesh.from_group(ep_group, weights[0].device.type, mesh_dim_names=("ep",))
    for name, weight in zip(_WEIGHTS, weights, strict=True):
        piece = weight.detach()[rank * local : (rank + 1) * local].clone()
        shard = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=weight.requires_grad))
    _mark(experts)
    cls = type(experts)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {})
    experts.__class__ = _CLASSES[cls]
    experts.__dict__["ep_group"] = ep_group  # a plain attribute, beside the module's own
    return experts
