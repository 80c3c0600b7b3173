"""Shape-aware optimizers on sharded parameters: which optimizers the engine serves, and how.

[Note: served optimizers]
Most torch optimizers update every element from that element alone (and
global norms at most); they run unchanged on the sharded parameters, each
rank on its rows (``ELEMENTWISE_OPTIMIZERS``; ``register_elementwise_optimizer``
adds a class). Two need the matrix as a whole, and the engine serves them in
the optimizer's place, with torch's own state names, shapes and formulas:

- ``torch.optim.Muon`` orthogonalises each matrix's momentum-corrected update
  with Newton-Schulz iterations. The momentum and Nesterov steps are
  elementwise and run on the rows; each matrix's update is then gathered onto
  one owner rank (matrices spread over the ranks by Newton-Schulz cost, one
  all-to-all for all of them), the owner runs torch's Newton-Schulz once, and
  one all-to-all brings every rank its rows of the result, which it applies
  with Muon's weight decay and learning-rate adjustment. The rows travel in
  bf16 both ways: torch's Newton-Schulz casts its input to bf16 before
  anything else and returns bf16, so the owner orthogonalises exactly the
  matrix torch would (``test_shape_aware`` compares every step with torch's).
  Traffic per rank and step: its rows of the matrices it does not own, 4
  bytes per element.
- ``torch.optim.Adafactor`` factors the second moment into row and column
  statistics. Rows are whole on a rank, so the row statistics (sharded like
  the rows) are local; the column statistics of a 2-D parameter (replicated),
  and the norms Adafactor scales by (the parameter's RMS, the update's RMS),
  are sums over rows: each rank sums its rows and one all-reduce per phase
  completes every parameter's sums together.

The served step runs in the process-wide step pre-hook (``optim/optimizer.py``),
after the gradients are reduced; the served parameters' grads are hidden from
torch's own step and restored after it. Any other optimizer class holding
sharded parameters is refused (``check_supported``): its step could apply
matrix operations to row pieces and train on wrong values without an error.
This module neither reduces gradients nor installs weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from mf_dtensor import UnevenDTensor, boxes_numel, place_boxes, take_boxes
from mf_fsdp.buckets import collectives

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "check_supported",
    "init_served_state",
    "register_elementwise_optimizer",
    "serve_step",
    "served",
]

ELEMENTWISE_OPTIMIZERS: set[type[torch.optim.Optimizer]] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.ASGD,
    torch.optim.Rprop,
}
"""torch optimizers whose step treats every element on its own (plus global norms)."""


def register_elementwise_optimizer(cls: type[torch.optim.Optimizer]) -> None:
    """Declare that ``cls``'s step treats every element on its own (plus global norms).

    Such an optimizer runs unchanged on the sharded parameters. Declare only
    what is true: an optimizer that multiplies matrices, reshapes or slices a
    parameter would train on wrong values.

    Raises:
        TypeError: if ``cls`` is not a ``torch.optim.Optimizer`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"cls: expected a torch.optim.Optimizer subclass, got {cls!r}")
    ELEMENTWISE_OPTIMIZERS.add(cls)


def served(optimizer: torch.optim.Optimizer) -> _Server | None:
    """The engine's implementation of ``optimizer``'s step, or None for an elementwise one."""
    for cls, server in _SERVERS.items():
        if isinstance(optimizer, cls):
            return server
    return None


def check_supported(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Refuse an optimizer that would step its sharded parameters ``params`` wrongly.

    Raises:
        ValueError: naming the optimizer's class, if ``params`` has sharded parameters
            and the class is neither elementwise nor served; or if a served optimizer
            holds a parameter it cannot serve (Adafactor with a tp split of a trailing
            dim).
    """
    sharded = [p for p in params if isinstance(p, UnevenDTensor)]
    if not sharded:
        return
    server = served(optimizer)
    if server is None and not isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS)):
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise ValueError(
            f"optimizer: {name} is not known to work on mf's sharded parameters (each rank "
            "holds whole rows of every parameter); supported are torch's elementwise "
            "optimizers, torch.optim.Muon and torch.optim.Adafactor. If its step treats "
            "every element on its own, declare it with "
            "mf_fsdp.register_elementwise_optimizer(cls)"
        )
    if server is not None:
        server.check(optimizer, sharded)


def init_served_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create a served optimizer's state at its fresh values; False if it is not served."""
    server = served(optimizer)
    if server is None:
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and not optimizer.state.get(param):
                optimizer.state[param] = server.fresh_state(param)
    return True


def serve_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Run a served optimizer's step on its sharded parameters; return the parameters stepped.

    Collective (every rank steps its optimizers in the same order). The caller
    hides the returned parameters' grads from torch's own step.
    """
    server = served(optimizer)
    if server is None:
        return []
    with torch.no_grad():
        return server.step(optimizer)


# ----------------------------------------------------------------------------- helpers


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _grad_rows(param: UnevenDTensor) -> torch.Tensor:
    """This rank's rows of ``param``'s grad (a DTensor laid out as the parameter)."""
    grad = param.grad
    assert isinstance(grad, DTensor)  # the steps take parameters whose grad is set
    return grad.to_local()


def _shard_groups(tensor: UnevenDTensor) -> list[dist.ProcessGroup]:
    """The groups over which ``tensor``'s rows are spread (its ``Shard`` mesh dims)."""
    mesh = tensor.device_mesh
    return [mesh.get_group(d) for d, p in enumerate(tensor.placements) if isinstance(p, Shard)]


def _sum_over_rows(partials: Sequence[tuple[UnevenDTensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Complete per-rank partial sums over the ranks holding other rows, batched.

    Partials of tensors spread over the same groups go in one vector, all-reduced
    once per group.
    """
    batches: dict[tuple[int, ...], list[int]] = {}
    groups: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    for index, (tensor, _) in enumerate(partials):
        signature = _shard_groups(tensor)
        key = tuple(id(g) for g in signature)
        batches.setdefault(key, []).append(index)
        groups[key] = signature
    results: list[torch.Tensor] = [partial for _, partial in partials]
    for key, indices in batches.items():
        flat = torch.cat([results[i].reshape(-1) for i in indices])
        for group in groups[key]:
            collectives.all_reduce(flat, dist.ReduceOp.SUM, group)
        offset = 0
        for i in indices:
            numel = results[i].numel()
            results[i] = flat[offset : offset + numel].view(results[i].shape)
            offset += numel
    return results


@dataclass(frozen=True, slots=True)
class _ReducedPieces:
    """The pieces of a tensor reduced to size 1 along ``dim`` (a row statistic of a sharded one)."""

    base: Any  # the parameter's PieceMap
    dim: int

    def __deepcopy__(self, memo: dict[int, object]) -> _ReducedPieces:
        return self

    def boxes(self, mesh_index: int) -> tuple[ChunkStorageMetadata, ...]:
        out = []
        for box in self.base.boxes(mesh_index):
            offsets, sizes = list(box.offsets), list(box.sizes)
            offsets[self.dim], sizes[self.dim] = 0, 1
            out.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        return tuple(out)


def _sharded_zeros(param: UnevenDTensor, reduce_dim: int) -> UnevenDTensor:
    """Zeros shaped like ``param`` reduced to size 1 along ``reduce_dim``, sharded like its rows."""
    shape = list(param.shape)
    shape[reduce_dim] = 1
    local_shape = list(param.to_local().shape)
    local_shape[reduce_dim] = 1
    local = param.to_local().new_zeros(local_shape)
    pieces = _ReducedPieces(param.pieces, reduce_dim % param.dim())
    return UnevenDTensor.from_local(
        local, param.device_mesh, param.placements, shape=shape, pieces=pieces
    )


class _Server:
    """What the engine does in a served optimizer's place."""

    def check(self, optimizer: torch.optim.Optimizer, params: list[UnevenDTensor]) -> None:
        """Raise ValueError for a parameter this server cannot step."""

    def fresh_state(self, param: torch.Tensor) -> dict[str, Any]:
        """The state torch would create for ``param`` at its first step."""
        raise NotImplementedError

    def step(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Step every sharded parameter with a grad; return them."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- Muon


@dataclass(frozen=True, slots=True)
class _Exchange:
    """Who sends which rows of which matrices where: the owner gather and its reverse.

    Attributes:
        owners: the owner's global rank, per matrix.
        send_counts: elements this rank sends to each rank (its rows of their matrices).
        recv_counts: elements this rank receives from each rank (rows of its matrices).
        members: per matrix this rank owns: ``(global rank, boxes)`` of every rank
            holding rows of it, in the order their rows arrive.
    """

    owners: tuple[int, ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    members: dict[int, tuple[tuple[int, tuple[ChunkStorageMetadata, ...]], ...]]


def _exchange_plan(tensors: Sequence[UnevenDTensor]) -> _Exchange:
    """Balance the matrices over the ranks by Newton-Schulz cost and plan the all-to-alls.

    Ranks that hold the same rows (``Replicate`` mesh dims: HSDP replicas, tp
    copies of a duplicated matrix) form separate classes; each class gathers
    and orthogonalises its own matrices. Pure: every rank computes the same plan
    for its class, with no communication.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    load: dict[int, float] = {}
    owners: list[int] = []
    send = [0] * world
    recv = [0] * world
    members: dict[int, tuple[tuple[int, tuple[ChunkStorageMetadata, ...]], ...]] = {}
    order = sorted(range(len(tensors)), key=lambda i: -_ns_cost(tensors[i].shape))
    owner_of: dict[int, int] = {}
    holders_of: dict[int, list[tuple[int, tuple[ChunkStorageMetadata, ...]]]] = {}
    for i in order:
        holders = _holders(tensors[i])
        holders_of[i] = holders
        ranks = [rank for rank, _ in holders]
        owner = min(ranks, key=lambda rank: (load.get(rank, 0.0), rank))
        load[owner] = load.get(owner, 0.0) + _ns_cost(tensors[i].shape)
        owner_of[i] = owner
    for i in range(len(tensors)):
        owner = owner_of[i]
        owners.append(owner)
        holders = holders_of[i]
        for rank, boxes in holders:
            if rank == me:
                send[owner] += boxes_numel(boxes)
            if owner == me:
                recv[rank] += boxes_numel(boxes)
        if owner == me:
            members[i] = tuple(holders)
    return _Exchange(tuple(owners), tuple(send), tuple(recv), members)


def _ns_cost(shape: torch.Size) -> float:
    """Newton-Schulz's multiply-adds per iteration on a matrix of ``shape``.

    With n <= m its sides: the n x n Gram matrix (n*n*m), its square (n^3) and the
    update (n*n*m). Times on one CPU thread follow it within 20% from 512 x 512 to
    4096 x 1024.
    """
    n, m = sorted((shape[0], shape[1]))
    return float(n * n * (2 * m + n))


def _holders(tensor: UnevenDTensor) -> list[tuple[int, tuple[ChunkStorageMetadata, ...]]]:
    """``(global rank, boxes)`` of the ranks sharing this rank's ``Replicate`` coordinates."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # this rank holds rows of the tensor, so is in its mesh
    replicated = [d for d, p in enumerate(tensor.placements) if not isinstance(p, Shard)]
    ranks = mesh.mesh.flatten().tolist()
    holders = []
    for index, rank in enumerate(ranks):
        position = []
        rest = index
        for size in reversed(mesh.shape):
            position.append(rest % size)
            rest //= size
        position.reverse()
        if all(position[d] == coordinate[d] for d in replicated):
            holders.append((rank, tuple(tensor.pieces.boxes(index))))
    return holders


def _gather_apply_scatter(
    rows: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    plan: _Exchange,
    apply: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Gather each matrix onto its owner, ``apply`` there once, send every rank its rows back.

    ``rows`` are this rank's rows of matrices of global ``shapes``. Two
    all-to-alls over the world group for all matrices together, in ``dtype``
    (each row is copied once into the send buffer, converting on the way).
    Returns this rank's rows of each ``apply`` result, in ``dtype``.
    """
    segments = _segment_starts(plan.send_counts)
    offsets = []  # where each matrix's rows sit in the buffers laid out by owner
    for index, local in enumerate(rows):
        owner = plan.owners[index]
        offsets.append(segments[owner])
        segments[owner] += local.numel()
    send = torch.empty(sum(plan.send_counts), dtype=dtype, device=rows[0].device)
    for local, offset in zip(rows, offsets, strict=True):
        send[offset : offset + local.numel()].view(local.shape).copy_(local)
    received = send.new_empty(sum(plan.recv_counts))
    collectives.all_to_all(received, send, list(plan.recv_counts), list(plan.send_counts))
    # From each rank, its rows of the matrices this rank owns, in matrix order; the
    # results go back in the same places.
    send_back = torch.empty_like(received)
    cursor = _segment_starts(plan.recv_counts)
    for index in sorted(plan.members):
        full = received.new_empty(tuple(shapes[index]))
        places = []
        for rank, boxes in plan.members[index]:
            end = cursor[rank] + boxes_numel(boxes)
            place_boxes(full, received[cursor[rank] : end], boxes)
            places.append((send_back[cursor[rank] : end], boxes))
            cursor[rank] = end
        result = apply(full)
        for flat, boxes in places:
            take_boxes(result, boxes, flat)
    returned = torch.empty_like(send)
    collectives.all_to_all(returned, send_back, list(plan.send_counts), list(plan.recv_counts))
    return [
        returned[offset : offset + local.numel()].view(local.shape)
        for local, offset in zip(rows, offsets, strict=True)
    ]


def _segment_starts(counts: Sequence[int]) -> list[int]:
    """Where each rank's segment starts in a buffer laid out by rank."""
    starts, position = [], 0
    for count in counts:
        starts.append(position)
        position += count
    return starts


_NEWTON_SCHULZ_DTYPE = torch.bfloat16
"""What torch's ``_zeropower_via_newtonschulz`` casts its input to first, and returns."""


class _MuonServer(_Server):
    """torch.optim.Muon: elementwise parts on the rows, Newton-Schulz once per matrix."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, ...], _Exchange] = {}

    def fresh_state(self, param: torch.Tensor) -> dict[str, Any]:
        return {"momentum_buffer": torch.zeros_like(param)}

    def step(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        stepped: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            params = [
                p for p in group["params"] if isinstance(p, UnevenDTensor) and p.grad is not None
            ]
            if not params:
                continue
            lr, wd, momentum = _scalar(group["lr"]), group["weight_decay"], group["momentum"]
            updates = []
            for param in params:  # on the local rows: the same elementwise ops as torch's
                state = optimizer.state[param]
                if "momentum_buffer" not in state:
                    state.update(self.fresh_state(param))
                buffer, grad = state["momentum_buffer"].to_local(), _grad_rows(param)
                buffer.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
            key = tuple(id(p.pieces) for p in params)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = _exchange_plan(params)

            def orthogonalise(full: torch.Tensor, group: dict[str, Any] = group) -> torch.Tensor:
                return _zeropower_via_newtonschulz(
                    full, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )

            shapes = [param.shape for param in params]
            rows = _gather_apply_scatter(updates, shapes, plan, orthogonalise, _NEWTON_SCHULZ_DTYPE)
            for param, ortho in zip(params, rows, strict=True):
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                local = param.to_local()
                local.mul_(1 - lr * wd)
                local.add_(ortho, alpha=-adjusted)
            stepped.extend(params)
        return stepped


# ----------------------------------------------------------------------------- Adafactor


class _AdafactorServer(_Server):
    """torch.optim.Adafactor: row statistics on the rows, sums over rows all-reduced."""

    def check(self, optimizer: torch.optim.Optimizer, params: list[UnevenDTensor]) -> None:
        for param in params:
            split = [p.dim for p in param.placements if isinstance(p, Shard) and p.dim != 0]
            if split:
                raise ValueError(
                    f"optimizer: torch.optim.Adafactor cannot step a parameter of shape "
                    f"{tuple(param.shape)} split along dim {split[0]} (placements "
                    f"{tuple(param.placements)!r}): its row statistics need whole rows; "
                    "expected parameters sharded along dim 0 only"
                )

    def fresh_state(self, param: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.get_default_dtype())}
        if param.dim() > 1:
            state["row_var"] = (
                _sharded_zeros(param, -1)
                if isinstance(param, UnevenDTensor)
                else (param.new_zeros((*param.shape[:-1], 1)))
            )
            col_shape = [*param.shape[:-2], 1, param.shape[-1]]
            if isinstance(param, UnevenDTensor) and param.dim() > 2:
                state["col_var"] = _sharded_zeros(param, -2)
            else:
                local = param.to_local() if isinstance(param, UnevenDTensor) else param
                state["col_var"] = local.new_zeros(col_shape)
        else:
            state["variance"] = torch.zeros_like(param)
        return state

    def step(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        stepped: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            params = [
                p for p in group["params"] if isinstance(p, UnevenDTensor) and p.grad is not None
            ]
            if params:
                self._step_group(optimizer, group, params)
                stepped.extend(params)
        return stepped

    def _step_group(
        self, optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[UnevenDTensor]
    ) -> None:
        lr = _scalar(group["lr"])
        eps1_option, eps2 = group["eps"]
        wd, d, decay = group["weight_decay"], group["d"], group["beta2_decay"]
        states = []
        for param in params:
            state = optimizer.state[param]
            if not state:
                state.update(self.fresh_state(param))
            states.append(state)
        grads = [-_grad_rows(p) if group["maximize"] else _grad_rows(p) for p in params]
        locals_ = [p.to_local() for p in params]
        # Phase 1: the parameters' squared norms and, for matrices, the column sums of g^2.
        partials = [
            (p, local.square().sum().reshape(1)) for p, local in zip(params, locals_, strict=True)
        ]
        for param, grad in zip(params, grads, strict=True):
            if param.dim() == 2:
                col = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_()
                partials.append((param, col))
        sums = _sum_over_rows(partials)
        norms, cols = sums[: len(params)], iter(sums[len(params) :])
        alphas, betas = [], []
        for param, state, norm_sq in zip(params, states, norms, strict=True):
            state["step"] += 1
            step = state["step"].item()
            betas.append(step**decay)
            rho = min(lr, 1 / (step**0.5))
            rms = math.sqrt(norm_sq.item()) / (param.numel() ** 0.5)
            alphas.append(max(eps2, rms) * rho)
        estimates = []
        row_means = []
        for param, grad, local, state, beta in zip(
            params, grads, locals_, states, betas, strict=True
        ):
            eps1 = eps1_option if eps1_option is not None else torch.finfo(param.dtype).eps
            if wd != 0:
                local.mul_(1 - lr * wd)
            if param.dim() > 1:
                row_var = state["row_var"].to_local()
                row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_()
                row_var.lerp_(row_mean.div_(grad.size(-1)), beta)
                col_var = state["col_var"]
                col_var = col_var.to_local() if isinstance(col_var, UnevenDTensor) else col_var
                col_mean = (
                    next(cols)
                    if param.dim() == 2
                    else (torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_())
                )
                col_var.lerp_(col_mean.div_(param.shape[-2]), beta)
                estimates.append((row_var @ col_var, eps1))
                if param.dim() == 2:  # the mean over dim -2 spans every rank's rows
                    row_means.append((param, row_var.sum(dim=-2, keepdim=True)))
            else:
                variance = state["variance"].to_local()
                variance.lerp_(grad * grad, beta)
                estimates.append((variance.clone(), eps1))
        # Phase 2: the row statistics' means over all rows (dim -2 of a matrix is the rows).
        row_sums = iter(_sum_over_rows(row_means))
        updates = []
        partials = []
        for param, grad, (estimate, eps1), state in zip(
            params, grads, estimates, states, strict=True
        ):
            if param.dim() > 1:
                if param.dim() == 2:
                    mean = next(row_sums) / param.shape[-2]
                else:
                    mean = state["row_var"].to_local().mean(dim=-2, keepdim=True)
                estimate.div_(mean.clamp_(min=eps1))
            update = estimate.clamp_(min=eps1 * eps1).rsqrt_()
            update.mul_(grad)
            updates.append(update)
            partials.append((param, update.square().sum().reshape(1)))
        # Phase 3: the updates' squared norms.
        update_norms = _sum_over_rows(partials)
        for param, local, update, norm_sq, alpha in zip(
            params, locals_, updates, update_norms, alphas, strict=True
        ):
            denom = max(1.0, math.sqrt(norm_sq.item()) / ((param.numel() ** 0.5) * d))
            local.add_(update, alpha=-alpha / denom)


_SERVERS: dict[type[torch.optim.Optimizer], _Server] = {}
if hasattr(torch.optim, "Muon"):
    _SERVERS[torch.optim.Muon] = _MuonServer()
if hasattr(torch.optim, "Adafactor"):
    _SERVERS[torch.optim.Adafactor] = _AdafactorServer()
