"""A mixture-of-experts layer's experts as grouped 3-D weights, run by one grouped matmul.

Responsibility: hold ``G`` experts' MLPs (``out(gelu(fc(x)))``, the same function as
:class:`mf_tp.ExpertMLP`) as four parameters with a leading expert dim, the layout
2026's MoE models store (torchtitan's ``w1`` / ``w2``, transformers' ``gate_up_proj`` /
``down_proj``): ``fc_weight [G, F, H]``, ``fc_bias [G, F]``, ``out_weight [G, H, F]``,
``out_bias [G, H]``, each expert's slice laid out as ``nn.Linear``'s ``[out, in]``; and
apply expert ``g`` to its contiguous block of rows, for every ``g`` at once.

Two paths compute the same thing:

- ``grouped_mm``: one ``torch._grouped_mm`` per weight, where the installed torch has it
  for the device and dtype: the CPU in fp32, bf16 and fp16 (torch 2.11 and 2.15), CUDA in
  bf16 on compute capability 9.0 and above (Hopper's grouped GEMM). Its kernels also want
  16-byte aligned pointers and strides;
- ``loop``: one ``matmul`` per expert block, exact everywhere else (float64, sizes whose
  rows are not 16-byte multiples, other devices, a torch without the op).

:func:`grouped_mm_path` names the path a call takes. On the CPU in fp32 both give the
same bits; on a GPU the grouped kernel is one launch where the loop is ``G``.

It must not: route or move tokens (that is :mod:`mf_tp.moe`), or communicate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mf_utils import set_expert_parallel_attribute

__all__ = [
    "GROUPED_EXPERT_PARAMETERS",
    "GroupedExperts",
    "RowGroups",
    "convert_per_expert_state_dict",
    "grouped_linear",
    "grouped_mm_path",
]

# The grouped parameters and the per-expert ``nn.Linear`` entries they stack.
GROUPED_EXPERT_PARAMETERS = {
    "fc_weight": "fc.weight",
    "fc_bias": "fc.bias",
    "out_weight": "out.weight",
    "out_bias": "out.bias",
}
_ALIGN_BYTES = 16  # the grouped kernels' alignment of pointers and row strides
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PER_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<index>\d+)\.(?P<entry>\w+\.\w+)$")


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    strides_ok = all(s == 1 or (s * size) % _ALIGN_BYTES == 0 for s in t.stride())
    return strides_ok and t.data_ptr() % _ALIGN_BYTES == 0


def grouped_mm_path(inputs: torch.Tensor, weight: torch.Tensor) -> str:
    """``"grouped_mm"`` when ``torch._grouped_mm`` serves ``inputs @ weight[g].T``, else ``"loop"``.

    Args:
        inputs: ``[N, in]`` rows.
        weight: ``[G, out, in]`` grouped weight.
    """
    if not hasattr(torch, "_grouped_mm") or inputs.dtype != weight.dtype:
        return "loop"
    device = inputs.device
    if device.type == "cpu":
        supported = inputs.dtype in _CPU_DTYPES
    elif device.type == "cuda":
        supported = inputs.dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (
            9,
            0,
        )
    else:
        supported = False
    if not supported:
        return "loop"
    return "grouped_mm" if _aligned(inputs) and _aligned(weight.transpose(-2, -1)) else "loop"


@dataclass(frozen=True, slots=True)
class RowGroups:
    """Rows of ``G`` groups back to back: the counts, and the index tensors both paths read.

    Built once per layer call and shared by its linears, so the host-to-device copies of
    the counts happen once.

    Attributes:
        counts: rows of each group (zeros allowed).
        ends: ``[G]`` int32 cumulative counts (``torch._grouped_mm``'s ``offs``).
        group_of_row: ``[N]`` long, the group of each row (for the biases).
    """

    counts: tuple[int, ...]
    ends: torch.Tensor
    group_of_row: torch.Tensor

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device) -> RowGroups:
        """The groups of ``counts`` with their index tensors on ``device``."""
        counts_t = torch.tensor(list(counts), dtype=torch.long).to(device, non_blocking=True)
        rows = sum(counts)
        group_of_row = torch.repeat_interleave(
            torch.arange(len(counts), device=device), counts_t, output_size=rows
        )
        return cls(tuple(counts), counts_t.cumsum(0).to(torch.int32), group_of_row)


def grouped_linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: RowGroups
) -> torch.Tensor:
    """``out[rows of g] = inputs[rows of g] @ weight[g].T + bias[g]``, for every group ``g``.

    Args:
        inputs: ``[N, in]``, the rows of group 0 first, then group 1, ...
        weight: ``[G, out, in]``.
        bias: ``[G, out]`` or None.
        groups: the ``G`` groups' rows (:meth:`RowGroups.of`), summing to ``N``.

    Returns:
        ``[N, out]`` in ``inputs``' dtype, with autograd to all three tensors.
    """
    if len(groups.counts) != weight.shape[0] or sum(groups.counts) != inputs.shape[0]:
        raise ValueError(
            f"grouped_linear: rows per group {list(groups.counts)} must have one count per "
            f"group ({weight.shape[0]}) summing to the {inputs.shape[0]} input rows"
        )
    if grouped_mm_path(inputs, weight) == "grouped_mm":
        out = torch._grouped_mm(inputs, weight.transpose(-2, -1), offs=groups.ends)
        if out.requires_grad:  # its backward refuses an expanded gradient (from a .sum())
            out.register_hook(torch.Tensor.contiguous)
    else:
        blocks = inputs.split(list(groups.counts), dim=0)
        # unbind, not weight[g]: each indexing's backward would write a zero-filled
        # [G, out, in] gradient (G^2 work over G experts); unbind's stacks them once.
        pieces = weight.unbind(0)
        out = torch.cat([block @ w.T for block, w in zip(blocks, pieces, strict=True)], dim=0)
    return out if bias is None else out + bias.index_select(0, groups.group_of_row)


class GroupedExperts(nn.Module):
    """``num_experts`` expert MLPs (``out(gelu(fc(x)))``, ``[N, H] -> [N, H]``) as grouped weights.

    Every parameter is parameter-shaped over all ``E`` experts (``fc_weight [E, F, H]``),
    whatever the expert-parallel size: with an ``ep_group`` of size ``p`` it is a DTensor
    ``Shard(0)`` over a 1-D ``ep`` mesh of that group (torchtitan's form), each rank's local
    tensor its ``E / p`` experts ``[r * E/p, (r + 1) * E/p)``; without one, a plain tensor.
    So a state dict holds the same full ``[E, ...]`` tensors at any EP size.

    Every parameter carries the expert mark (:func:`mf_utils.set_expert_parallel_attribute`),
    so data-parallel reductions treat it as an expert's. Built on the meta device, the
    parameters are left uninitialised until :meth:`load_initial_weights`.
    """

    fc_weight: nn.Parameter
    fc_bias: nn.Parameter
    out_weight: nn.Parameter
    out_bias: nn.Parameter

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        ep_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedExperts: {name} must be a positive int, got {value!r}")
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        if num_experts % ep_size != 0:
            raise ValueError(
                f"GroupedExperts: num_experts {num_experts} is not divisible by the "
                f"expert-parallel (EP) size {ep_size}; every EP rank must own the same number "
                "of experts"
            )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_local_experts = num_experts // ep_size
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.first_local_expert = ep_rank * self.num_local_experts
        target = torch.device(device) if device is not None else torch.get_default_device()
        mesh = None
        if ep_size > 1:
            assert ep_group is not None  # a size above 1 comes from a group
            mesh_device = "cpu" if target.type == "meta" else target.type
            mesh = DeviceMesh.from_group(ep_group, mesh_device, mesh_dim_names=("ep",))
        g, h, f = self.num_local_experts, hidden_size, ffn_hidden_size
        shapes = {
            "fc_weight": (g, f, h),
            "fc_bias": (g, f),
            "out_weight": (g, h, f),
            "out_bias": (g, h),
        }
        for name, shape in shapes.items():
            local = torch.empty(shape, device=target, dtype=dtype)
            data = (
                local
                if mesh is None
                else DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            )
            self.register_parameter(name, nn.Parameter(data))
        self.mark_expert_parameters()

    def mark_expert_parameters(self) -> None:
        """Set the expert mark on every parameter."""
        for param in self.parameters():
            set_expert_parallel_attribute(param)

    def _apply(self, fn: Any, recurse: bool = True) -> GroupedExperts:
        """``to``, ``to_empty``, ``float`` ...: then mark the parameters again.

        On DTensor parameters ``nn.Module._apply`` swaps in new tensors, which carry no
        attribute of the old ones; without the mark the experts would be taken for
        dense parameters.
        """
        result = super()._apply(fn, recurse)
        self.mark_expert_parameters()
        return result

    def load_initial_weights(self, drawn: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Copy one dict per expert, all ``E`` (``fc.weight``, ``fc.bias``, ...); keep the local."""
        if len(drawn) != self.num_experts:
            raise ValueError(
                f"GroupedExperts.load_initial_weights: expected {self.num_experts} experts' "
                f"weights, got {len(drawn)}"
            )
        local = drawn[self.first_local_expert : self.first_local_expert + self.num_local_experts]
        with torch.no_grad():
            for name, entry in GROUPED_EXPERT_PARAMETERS.items():
                _local(self.get_parameter(name)).copy_(torch.stack([d[entry] for d in local]))
        self.mark_expert_parameters()

    def forward(self, hidden_states: torch.Tensor, rows_per_expert: Sequence[int]) -> torch.Tensor:
        """Apply local expert ``l`` to its block of ``rows_per_expert[l]`` rows, in order."""
        groups = RowGroups.of(rows_per_expert, hidden_states.device)
        fc_weight, fc_bias, out_weight, out_bias = (
            _local(p) for p in (self.fc_weight, self.fc_bias, self.out_weight, self.out_bias)
        )
        hidden = grouped_linear(hidden_states, fc_weight, fc_bias, groups)
        return grouped_linear(F.gelu(hidden), out_weight, out_bias, groups)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of ``param`` (the local tensor of a DTensor, with autograd)."""
    return param.to_local() if isinstance(param, DTensor) else param


def convert_per_expert_state_dict(
    state_dict: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """A state dict with per-expert entries (``...experts.5.fc.weight``) in the grouped layout.

    Each layer's ``experts.<i>.fc.weight`` for ``i = 0 .. E-1`` becomes one
    ``experts.fc_weight [E, F, H]`` (likewise ``fc.bias``, ``out.weight``, ``out.bias``);
    every other entry is kept as it is. Checkpoints of mf-tp before 0.3.0 load after it.

    Raises:
        ValueError: when a layer's expert indices are not ``0 .. E-1``, or an entry is
            missing for some expert.
    """
    converted: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # prefix -> entry -> index
    for key, value in state_dict.items():
        match = _PER_EXPERT_KEY.match(key)
        if match is None or match["entry"] not in GROUPED_EXPERT_PARAMETERS.values():
            converted[key] = value
            continue
        entries = layers.setdefault(match["prefix"], {})
        entries.setdefault(match["entry"], {})[int(match["index"])] = value
    for prefix, entries in layers.items():
        experts = {tuple(sorted(by_index)) for by_index in entries.values()}
        every = tuple(range(max(len(by_index) for by_index in entries.values())))
        if set(entries) != set(GROUPED_EXPERT_PARAMETERS.values()) or experts != {every}:
            raise ValueError(
                f"convert_per_expert_state_dict: {prefix}<i> has entries {sorted(entries)} for "
                f"experts {sorted(set().union(*experts))}; expected "
                f"{sorted(GROUPED_EXPERT_PARAMETERS.values())} for every expert 0..E-1 (a "
                "whole model's checkpoint, not one expert-parallel rank's)"
            )
        for name, entry in GROUPED_EXPERT_PARAMETERS.items():
            converted[prefix + name] = torch.stack([entries[entry][i] for i in every])
    return converted
