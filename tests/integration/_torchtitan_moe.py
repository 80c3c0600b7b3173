"""The runs every torchtitan MoE parity test shares: one model, two engines, one script.

A test names its model by a :class:`TitanMoE` (how to build the config, its
sharding configs, which torchtitan ``parallelize_*`` applies EP, TP and FSDP to
it; :func:`tiny_config` holds what the models' configs share) and calls one of
two rank functions on every rank. Both parallelize the model with torchtitan's
own function, twice: once with torch's ``fully_shard``, once with
``mf_fsdp.fsdp2.fully_shard`` swapped in (``test_torchtitan_fsdp2``'s way), from
one process's weights, and run torchtitan's script (FSDP's division off, the
loss over the data-parallel size, its EP-aware gradient clipping) in fp32.

- :func:`rank_parity`: dp_shard=world x ep 2, AdamW; the engines must agree
  (first-step gradients, gradient norms, losses, weights), and mf's state dict,
  saved by DCP, must load into a fresh FSDP2 model with mf's values, bit for bit.
- :func:`rank_layout_parity`: any :class:`Layout` (TP, EP or both), SGD with
  momentum or AdamW, 3 steps; each engine must equal one process on the global
  batch (losses, torchtitan's gradient norms against torch's ``clip_grad_norm_``,
  first-step gradients, final weights, 1e-5), with the routed experts' GEMMs in fp32
  (torchtitan runs them in bf16 whatever the parameter dtype).

Importing this module imports torchtitan: a test module imports it inside the
guard that skips where torchtitan does not import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.distributed.parallel_dims as titan_dims
import torchtitan.distributed.utils as titan_utils
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts

from mf_fsdp import fsdp2
from tests.integration.test_torchtitan_fsdp2 import _loss, sharded_dims

VOCAB, DIM, SEQ, BATCH, STEPS, EP = 256, 64, 16, 2, 2, 2
LAYOUT_STEPS = 3


@dataclass(frozen=True)
class TitanMoE:
    """A torchtitan MoE model as the parity run needs it (module-level, so ranks pickle it).

    ``config`` builds the model's config (vocabulary :data:`VOCAB`) from the routed
    expert count; ``sharding`` is the model's ``set_*_sharding_config`` (the
    trainer's call, ``enable_sp``/``enable_ep`` from the parallelism config);
    ``parallelize`` is the model's torchtitan ``parallelize_*`` function.
    """

    config: Callable[[int], object]
    sharding: Callable[..., None]
    parallelize: Callable[..., object]


@dataclass(frozen=True)
class Layout:
    """torchtitan's degrees for one run: ``dp_shard`` x ``tp`` ranks, EP degree ``ep``."""

    dp_shard: int
    tp: int = 1
    ep: int = EP

    @property
    def world(self) -> int:
        return self.dp_shard * self.tp

    def dims(self) -> titan_dims.ParallelDims:
        """torchtitan's ``ParallelDims`` (``partial_dtensor`` backend) for this layout."""
        return titan_dims.ParallelDims(
            dp_replicate=1,
            dp_shard=self.dp_shard,
            cp=1,
            tp=self.tp,
            pp=1,
            ep=self.ep,
            world_size=self.world,
            spmd_backend="partial_dtensor",
        )


def _with_sdpa(layers: list) -> list:
    """The blocks with SDPA as inner attention (torchtitan's flex attention has no CPU
    backward; its SDPA is causal, as the debug models' block-causal mask is on one document)."""
    sdpa = ScaledDotProductAttention.Config()
    return [
        dataclasses.replace(
            layer, attention=dataclasses.replace(layer.attention, inner_attention=sdpa)
        )
        for layer in layers
    ]


def tiny_config(
    model: type,
    *,
    layers: list,
    norm: object,
    embedding_init: object,
    lm_head_init: object,
    **fields: object,
) -> object:
    """``model.Config`` of width :data:`DIM` over :data:`VOCAB` tokens with ``layers``
    (made to attend through SDPA); :func:`parallelized` sets its sharding configs.

    ``norm`` is the final norm's config, ``embedding_init`` and ``lm_head_init``
    the model's own initializers; ``fields`` are the model's further config fields.
    """
    return model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=norm,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding_init
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=lm_head_init),
        layers=_with_sdpa(layers),
        **fields,
    )


def plain(moe: TitanMoE, experts: int):
    """One process's model and initial weights (the values both engines start from)."""
    with torch.device("meta"):
        model = moe.config(experts).build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def parallelized(moe: TitanMoE, shard, experts: int, tmp: str, layout: Layout | None = None):
    """torchtitan's parallelize over ``layout`` (dp_shard=world, ep=2 by default) with
    ``fully_shard`` = ``shard``; one process's initial weights.

    Sequence parallelism is on under TP (torchtitan's default).
    """
    dims = layout.dims() if layout is not None else sharded_dims(ep=EP)
    config = moe.config(experts)
    moe.sharding(config, enable_sp=dims.tp_enabled, enable_ep=dims.ep_enabled)
    with torch.device("meta"):
        model = config.build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ):
        titan_utils.set_spmd_backend("partial_dtensor")  # the trainer's call, from its config
        dims.build_mesh()
        moe.parallelize(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(
                spmd_backend="partial_dtensor",
                expert_parallel_degree=dims.ep,
                tensor_parallel_degree=dims.tp,
            ),
            compile_config=CompileConfig(enable=False, components=["model"]),
            ac_config=None,
            dump_folder=tmp,
        )
    assert isinstance(model.layers["0"], TorchFSDPModule)
    if shard is torch_fully_shard:  # gloo has no PREMUL_SUM, which factor 1.0 asks of torch
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    _start_from(model, plain(moe, experts), mf=shard is not torch_fully_shard)
    return model


def _start_from(model, reference, mf: bool) -> None:
    """Give ``model`` one process's parameters: mf loads full tensors, FSDP2 its own shards.

    The buffers are torchtitan's init's (``init_weights``, as one process's): under TP
    they are DTensors, which a plain state-dict value does not load into.
    """
    if mf:
        weights = dict(reference.named_parameters())
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        assert not set(missing) & weights.keys(), missing
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, rank: int, world: int) -> tuple[list[float], torch.Tensor, dict]:
    """AdamW steps with torchtitan's scaling (FSDP's division off, each loss over ``world``)
    and its EP-aware gradient clipping.

    Returns the losses, the gradient norms and the first step's gradients (AdamW's
    steps do not see a gradient's scale; the norms and gradients do).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step, rank)) / world
        loss.backward()
        if step == 0:
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        # The trainer's clipping: the experts' norm over their meshes, the rest over theirs.
        norms.append(titan_utils.clip_grad_norm_(model.parameters(), 0.05, ep_enabled=True))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, torch.stack(norms), grads


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW whose ``eps`` (1e-6) outweighs gradients of rounding size.

    With the default 1e-8, AdamW moves an element whose gradient is rounding noise
    (a cancelling sum, 1e-9 or so) by up to its learning rate, either way: one
    token embedding element of the EP x TP run ends 2e-5 from one process's, every
    other weight within 2e-6.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _global_loss(model, step: int, dp_rank: int, dp: int) -> torch.Tensor:
    """This dp rank's loss at ``step`` over ``dp`` (the logits whole: TP's are a DTensor)."""
    tokens, targets = _batch(step, dp_rank)
    logits = model(tokens)
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / dp


@dataclass
class Run:
    """What one engine's run leaves: per-step global losses and grad norms, the first
    step's full gradients, the final full weights."""

    losses: list[float]
    norms: list[float]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


def _train_on_layout(model, layout: Layout, optim: str, rank: int) -> Run:
    """:data:`LAYOUT_STEPS` steps with torchtitan's scaling (FSDP's division off, each dp
    rank's loss over the dp size; the tp ranks of a dp rank read its batch) and its own
    EP/TP-aware ``clip_grad_norm_`` (a bound no norm reaches: the norm is compared)."""
    opt = _optimizer(optim, model.parameters())
    run = Run([], [], {}, {})
    for step in range(LAYOUT_STEPS):
        loss = _global_loss(model, step, rank // layout.tp, layout.dp_shard)
        loss.backward()
        if step == 0:
            run.grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        norm = titan_utils.clip_grad_norm_(list(model.parameters()), 1e9, ep_enabled=layout.ep > 1)
        run.norms.append(_full(norm).item())
        opt.step()
        opt.zero_grad()
        total = loss.detach() / layout.tp  # the tp ranks of one dp rank hold its loss
        dist.all_reduce(total)
        run.losses.append(total.item())
    run.weights = _full_weights(model)
    return run


def _one_process(moe: TitanMoE, experts: int, layout: Layout, optim: str) -> Run:
    """One process on the global batch: each dp rank's part over the dp size; its norms
    are torch's ``clip_grad_norm_`` over the whole gradients."""
    model = plain(moe, experts)
    opt = _optimizer(optim, model.parameters())
    run = Run([], [], {}, {})
    for step in range(LAYOUT_STEPS):
        total = 0.0
        for dp_rank in range(layout.dp_shard):
            loss = _global_loss(model, step, dp_rank, layout.dp_shard)
            loss.backward()
            total += loss.item()
        if step == 0:
            run.grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        run.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        opt.zero_grad()
        run.losses.append(total)
    run.weights = _full_weights(model)
    return run


def _experts_in_fp32(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward`` in the activations' dtype (fp32 here).

    torchtitan 0.3 casts the experts' inputs and weights to bf16 for its grouped
    GEMMs whatever the parameter dtype, so their gradients reach the weights rounded
    to bf16, per rank: a sum over the ranks' tokens (EP) or over TP's halves of the
    hidden dim differs from one process's by bf16's rounding (about 2e-3 relative),
    under torch's FSDP2 as under mf. The same three grouped GEMMs in fp32 keep a
    comparison with one process at 1e-5. The dispatch, the placements and the
    sharding stay torchtitan's.
    """
    w1, w2, w3 = (
        w.to_local() if isinstance(w, DTensor) else w
        for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
    )
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    hidden = F.silu(torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offsets))
    hidden = hidden * torch._grouped_mm(tokens, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)


def rank_layout_parity(
    rank: int, world: int, moe: TitanMoE, experts: int, layout: Layout, optim: str
) -> None:
    """One rank of a run over ``layout`` (TP and/or EP): torch's FSDP2 and mf through
    torchtitan's parallelize, each equal to one process on the global batch (losses,
    grad norms, first-step gradients, final weights, 1e-5), their grad norms equal to
    each other's, with the routed experts in fp32 (:func:`_experts_in_fp32`)."""
    with mock.patch.object(GroupedExperts, "forward", _experts_in_fp32):
        _layout_parity(moe, experts, layout, optim, rank)


def _layout_parity(moe: TitanMoE, experts: int, layout: Layout, optim: str, rank: int) -> None:
    runs = {}
    for name, shard in (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard)):
        runs[name] = _train_on_layout(
            parallelized(moe, shard, experts, "unused", layout), layout, optim, rank
        )
    want = _one_process(moe, experts, layout, optim)
    for name, run in runs.items():
        _close(run.losses, want.losses, f"{name} losses", atol=1e-6)
        _close(run.norms, want.norms, f"{name} grad norms", atol=1e-6)
        assert run.grads.keys() == want.grads.keys() == run.weights.keys()
        for key, value in want.grads.items():
            _close(run.grads[key], value, f"{name} grad {key}", atol=1e-6)
        for key, value in want.weights.items():
            _close(run.weights[key], value, f"{name} weight {key}", atol=1e-5)
    torch.testing.assert_close(runs["mf"].norms, runs["torch"].norms, rtol=1e-5, atol=1e-7)
    assert want.losses[0] != want.losses[-1], "the model did not train"


def _close(got: object, want: object, what: str, atol: float) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in model.named_parameters()}


def rank_parity(rank: int, world: int, moe: TitanMoE, experts: int, tmp: str) -> None:
    """One rank of the parity run (see the module's docstring)."""
    runs, norms, grads, weights = {}, {}, {}, {}
    for name, shard in (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard)):
        model = parallelized(moe, shard, experts, tmp)
        runs[name], norms[name], grads[name] = _train(model, rank, world)
        weights[name] = _full_weights(model)
    # mf's state dict (experts as pieces over (efsdp, ep)) saved by DCP loads into a fresh
    # FSDP2 model (experts as _StridedShard over efsdp, Shard over ep) with mf's values.
    dcp.save(model.state_dict(), checkpoint_id=tmp)
    fresh = parallelized(moe, torch_fully_shard, experts, tmp)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state)
    torch.testing.assert_close(_full_weights(fresh), weights["mf"], rtol=0, atol=0)
    torch.testing.assert_close(runs["mf"], runs["torch"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms["mf"], norms["torch"], rtol=1e-5, atol=1e-7)
    assert weights["mf"].keys() == weights["torch"].keys()
    for name, value in grads["torch"].items():
        torch.testing.assert_close(grads["mf"][name], value, rtol=1e-5, atol=1e-8, msg=name)
    # AdamW moves an element whose gradients are rounding noise by up to lr (1e-3) a step,
    # either way: after the first step's equal gradients, two such elements of one expert
    # weight differ by 8.9e-5 (Qwen3, 2 experts), every other weight element by at most 5.7e-6.
    for name, value in weights["torch"].items():
        torch.testing.assert_close(weights["mf"][name], value, rtol=5e-5, atol=1e-4, msg=name)
