"""torch's FSDP2 training tests not in ``test_fsdp2_conformance``, on both engines.

Mirrors methods of ``test_fully_shard_training.py`` (``test/distributed/_composable/fsdp/``
in torch's sources): activation checkpointing with three groupings, the chunked
head of a language model called by itself, gradient accumulation by 1F1B,
``shard_placement_fn``, tied weights over uneven rows, a custom forward method,
one rank, and recovery after an exception. Each scenario runs with torch's
``fully_shard`` and with ``mf_fsdp.fsdp2.fully_shard`` in the same gloo ranks
(``tests.fsdp._fsdp2_port_common.on_both``) and makes torch's assertions against
torch's reference; values both engines return are compared too.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import (
    RANK_MODULES,
    WORLD,
    broadcast_params,
    check_sharded_parity,
    replicated_reference,
    torch_case,
)
from tests.fsdp._fsdp2_port_common import NEWER_FSDP2, full, on_both, train_pairs

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


def _average_grads(model: nn.Module) -> None:
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


# ------------------------------------------------------------ activation checkpointing
def _ac_parity(shard, reshard: bool, impl: str, grouping: str) -> list:
    case = torch_case()
    torch.manual_seed(42)
    args = ModelArgs(
        n_layers=3,
        n_heads=4,
        vocab_size=1024,
        max_seq_len=64,
        dropout_p=0,
        checkpoint_activations=impl == "utils",
        weight_tying=grouping != "mem_eff",
    )
    model = Transformer(args)
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ignore: tuple[str, ...] = ()
    if impl == "wrapper":
        ignore = (_CHECKPOINT_PREFIX,)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif impl == "composable":
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                checkpoint(module)
    kw = {"reshard_after_forward": reshard}
    if grouping == "mem_eff":
        shard(model.layers[0], **kw)
        shard([model.layers[1], model.layers[2]], **kw)
        shard([model.tok_embeddings, model.pos_embeddings], **kw)
        model.tok_embeddings.set_unshard_in_backward(False)
        shard([model.norm, model.output], **kw)
    elif grouping == "mem_eff_weight_tied":
        shard([model.tok_embeddings, model.output], **kw)
        for layer in model.layers:
            shard(layer, **kw)
    else:
        for layer in model.layers:
            shard(layer, **kw)
    shard(model, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, 1024, (3, 64))
    check_sharded_parity(case, ref_model, model, ignore)
    out = []
    for iter_idx in range(10):
        losses = []
        for one_model in (ref_model, model):
            torch.manual_seed(iter_idx + 1)
            losses.append(one_model(inp).sum())
            losses[-1].backward()
        check_sharded_parity(case, ref_model, model, ignore)
        case.assertEqual(losses[0], losses[1])
        for one_optim in (ref_optim, optim):
            one_optim.step()
            one_optim.zero_grad(set_to_none=iter_idx % 2 == 0)
        check_sharded_parity(case, ref_model, model, ignore)
        out.append(losses[1].detach())
    return out


def _rank_ac(rank: int, world: int, cases) -> None:
    case = torch_case()
    for reshard, impl, grouping in cases:
        on_both(case, _ac_parity, reshard, impl, grouping)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cases",
    [
        pytest.param([(True, "wrapper", "block")], id="block"),
        pytest.param([(True, "composable", "mem_eff_weight_tied")], id="weight-tied-ends"),
        pytest.param([(True, "composable", "mem_eff")], id="embeddings-not-unsharded"),
    ],
)
def test_train_parity_with_activation_checkpointing(cases) -> None:
    """``test_fully_shard_training.py::TestFullyShard1DTrainingCompose::test_train_parity_with_activation_checkpointing``.

    Kept for time, 1 of its 18 subtests: the ``block`` grouping with the wrapper
    (``reshard_after_forward`` True); the composable checkpoint over blocks runs in
    ``test_fsdp2_conformance``'s shared-params test.
    ``mem_eff_weight_tied`` (one unit over the embedding and the tied output) runs,
    and ``mem_eff`` (the embeddings' unit with ``set_unshard_in_backward(False)``).
    """
    run_on_ranks(_rank_ac, WORLD, cases)


# ------------------------------------------------------------ a chunked language-model head
class _ChunkedHead(nn.Module):
    """torch's ``ChunkedHeadModel``: embedding, body, norm and a head the loss may run alone."""

    def __init__(self, dim: int, vocab: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        hidden = self.norm(self.body(self.embed(tokens)))
        return hidden if skip_head else self.head(hidden)


def _chunked_model(tie: bool = False) -> _ChunkedHead:
    torch.manual_seed(42)
    model = _ChunkedHead(32, 128, tie)
    broadcast_params(model)
    return model


def _grad_accum_chunked(shard, reshard: bool) -> dict:
    case = torch_case()
    kw = {"reshard_after_forward": reshard}

    def build(grouped: bool) -> nn.Module:
        model = _chunked_model()
        shard(model.embed, **kw)
        shard(model.body, **kw)
        if grouped:
            shard([model.norm, model.head], **kw)
        else:
            shard(model.norm, **kw)
            shard(model.head, **kw)
        shard(model, **kw)
        return model

    ref_model, model = build(False), build(True)
    tokens = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
    for one in (ref_model, model):
        for i, tok in enumerate(tokens):
            last = i == len(tokens) - 1
            one.set_requires_gradient_sync(last)
            one.set_is_last_backward(last)
            hidden = one(tok, skip_head=True)
            hidden_grads = []
            for chunk in torch.chunk(hidden.detach(), 2, dim=1):
                chunk = chunk.contiguous().requires_grad_(True)
                one.head(chunk).sum().backward()
                hidden_grads.append(chunk.grad.detach())
            hidden.backward(torch.cat(hidden_grads, dim=1))
    pairs = zip(ref_model.named_parameters(), model.named_parameters(), strict=True)
    for (name, ref_p), (_, p) in pairs:
        case.assertEqual(full(ref_p.grad), full(p.grad), msg=name)
    return {name: full(p.grad) for name, p in model.named_parameters()}


# torch 2.11's FSDP2 dies by SIGSEGV on both gloo ranks in this scenario (2.15's runs it);
# there mf runs alone against the scenario's own grouped-versus-ungrouped check.


def _rank_grad_accum_chunked(rank: int, world: int) -> None:
    case = torch_case()
    for reshard in (True, False):
        torch.manual_seed(0)
        on_both(case, _grad_accum_chunked, reshard, torch_runs=NEWER_FSDP2)


@pytest.mark.multiprocess
def test_partial_group_forward_grad_accum_chunked() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_partial_group_forward_grad_accum_chunked``.

    Kept: both subtests. torch compares the grouped and ungrouped models' local
    pieces; here their whole gradients (mf's rows per rank follow its buckets, which
    a grouped unit changes), and mf's whole gradients equal torch's FSDP2's.
    """
    run_on_ranks(_rank_grad_accum_chunked, WORLD)


def _run_chunked(case, model: nn.Module, tokens: torch.Tensor, n_chunks: int = 4):
    """torch's chunked loss: the body's forward, the head per chunk, then the body's backward."""
    hidden = model(tokens, skip_head=True)
    chunks = torch.chunk(hidden.detach().float(), n_chunks, dim=1)
    total, hidden_grads, head_grads = torch.tensor(0.0), [], []
    for chunk in chunks:
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).sum()
        total += loss.detach()
        loss.backward()
        hidden_grads.append(chunk.grad.detach())
        head_grads.append(full(model.head.weight.grad))
    for i in range(1, len(head_grads)):  # every chunk adds to the head's grad
        case.assertGreater((head_grads[i] - head_grads[i - 1]).norm().item(), 0.0)
    hidden.backward(torch.cat(hidden_grads, dim=1).to(hidden.dtype))
    return total, head_grads[-1]


def _partial_then_standalone(shard, reshard: bool) -> list:
    case = torch_case()
    world = dist.get_world_size()
    kw = {"reshard_after_forward": reshard}

    def build(grouped: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _chunked_model()
        shard(model.embed, **kw)
        shard(model.body, **kw)
        if grouped:
            shard([model.norm, model.head], **kw)
        else:
            shard(model.norm, **kw)
            shard(model.head, **kw)
        shard(model, **kw)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    torch.manual_seed(42)
    tokens = torch.randint(0, 128, (2, 16))
    ref_model = _chunked_model()
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    model, optim = build(True)
    ungrouped, ungrouped_optim = build(False)
    out = []
    for iter_idx in range(10):
        loss, head_grad = _run_chunked(case, model, tokens)
        ug_loss, ug_head_grad = _run_chunked(case, ungrouped, tokens)
        case.assertEqual(ug_loss, loss)
        case.assertEqual(ug_head_grad, head_grad)
        for (name, ug_p), (_, p) in zip(
            ungrouped.named_parameters(), model.named_parameters(), strict=True
        ):
            case.assertEqual(full(ug_p.grad), full(p.grad), msg=name)
        ref_loss, ref_head_grad = _run_chunked(case, ref_model, tokens)
        _average_grads(ref_model)
        dist.all_reduce(ref_head_grad)
        case.assertEqual(head_grad, ref_head_grad / world)
        case.assertEqual(ref_loss, loss)
        check_sharded_parity(case, ref_model, model)
        for one in (ref_optim, optim, ungrouped_optim):
            one.step()
            one.zero_grad(set_to_none=iter_idx % 2 == 0)
        for (name, ug_p), (_, p) in zip(
            ungrouped.named_parameters(), model.named_parameters(), strict=True
        ):
            case.assertEqual(full(ug_p), full(p), msg=name)
        out.append(loss)
    return out


def _rank_partial_standalone(rank: int, world: int) -> None:
    case = torch_case()
    for reshard in (True, False):
        on_both(case, _partial_then_standalone, reshard, torch_runs=NEWER_FSDP2)


@pytest.mark.multiprocess
def test_partial_group_forward_then_standalone() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_partial_group_forward_then_standalone``.

    Kept: ``reshard_after_forward`` True/False without weight tying and without a
    mixed-precision policy (the subtests that compare with the plain reference).
    The grouped and ungrouped models' whole gradients and weights are compared
    (torch: local pieces; mf's rows follow its buckets).
    """
    run_on_ranks(_rank_partial_standalone, WORLD)


def _double_partial_forward(shard) -> dict:
    case = torch_case()
    model = _chunked_model()
    shard([model.norm, model.head])
    shard(model)
    tok1, tok2 = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    first, second = model(tok1, skip_head=True), model(tok2, skip_head=True)
    (first.sum() + second.sum()).backward()
    params = dict(model.named_parameters())
    for name in ("embed.weight", "norm.weight"):
        grad = params[name].grad
        case.assertIsNotNone(grad, name)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        case.assertTrue(torch.isfinite(local).all().item(), name)
    case.assertIsNone(model.head.weight.grad)
    return {name: full(p.grad) for name, p in params.items()}


def _rank_double_partial(rank: int, world: int) -> None:
    torch.manual_seed(0)
    on_both(torch_case(), _double_partial_forward)


@pytest.mark.multiprocess
def test_double_partial_forward_then_backward() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_double_partial_forward_then_backward``."""
    run_on_ranks(_rank_double_partial, WORLD)


class _Raiser(nn.Module):
    """torch's wrapper: its forward raises while armed."""

    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("armed")
        return self.wrapped(x)


def _reset_after_exception(shard) -> None:
    case = torch_case()
    model = _chunked_model()
    model.body = _Raiser(model.body)
    shard([model.norm, model.head])
    shard(model)
    tokens = torch.randint(0, 128, (2, 16))
    model.body.armed = True
    with case.assertRaises(RuntimeError):
        model(tokens, skip_head=True)
    model.body.armed = False
    model.reset_iter_state()
    model(tokens).sum().backward()
    for name, param in model.named_parameters():
        case.assertIsNotNone(param.grad, name)


def _reset_after_backward_exception(shard) -> dict:
    """Beyond torch's test: a backward cut short in its middle, then a whole step."""
    case = torch_case()
    model = _chunked_model()
    for module in (model.embed, model.body, model.norm):
        shard(module)
    shard(model)
    tokens = torch.randint(0, 128, (2, 16))

    def cut_short(*args: object) -> None:
        raise RuntimeError("armed")

    handle = model.norm.register_full_backward_hook(cut_short)  # after the head's backward
    out = model(tokens)
    with case.assertRaises(RuntimeError):
        out.sum().backward()
    handle.remove()
    del out
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    model(tokens).sum().backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}


def _rank_reset(rank: int, world: int) -> None:
    torch.manual_seed(0)
    on_both(torch_case(), _reset_after_exception, torch_needs="reset_iter_state")
    on_both(torch_case(), _reset_after_backward_exception, torch_needs="reset_iter_state")


@pytest.mark.multiprocess
def test_reset_iter_state_after_exception() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_reset_iter_state_after_exception``."""
    run_on_ranks(_rank_reset, WORLD)


# ------------------------------------------------------------ shard_placement_fn
def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(param.shape.index(max(param.shape)))


def _placement_largest_dim(shard) -> list:
    case = torch_case()
    torch.manual_seed(42)
    args = ModelArgs(n_layers=3, dropout_p=0.0)
    model = Transformer(args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for layer in model.layers:
        shard(layer, shard_placement_fn=_largest_dim)
    shard(model, shard_placement_fn=_largest_dim)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        case.assertEqual(param.full_tensor(), ref_param)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, args.vocab_size, (2, 16))
    out = []
    for _ in range(5):
        ref_loss, loss = ref_model(inp).sum(), model(inp).sum()
        case.assertEqual(ref_loss, loss)
        ref_loss.backward()
        loss.backward()
        _average_grads(ref_model)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
        out.append(loss.detach())
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        case.assertEqual(param.full_tensor(), ref_param)
    return out


def _rank_placement_largest(rank: int, world: int) -> None:
    on_both(torch_case(), _placement_largest_dim)


@pytest.mark.multiprocess
def test_train_parity_shard_placement_fn_shard_largest_dim() -> None:
    """``...::TestFullyShardShardPlacementFnMultiProcess::test_train_parity_shard_placement_fn_shard_largest_dim``.

    At world 2 (torch: 8); mf keeps its row layout for the ``Shard(dim)`` asked for.
    """
    run_on_ranks(_rank_placement_largest, WORLD)


def _contiguous_params_grads(shard) -> None:
    case = torch_case()
    model = MLP(dim=4)

    def placement(param: nn.Parameter) -> Shard:
        return Shard(1) if param.ndim > 1 else Shard(0)

    shard(model.in_proj, shard_placement_fn=placement)
    shard(model.out_proj, shard_placement_fn=placement)
    shard(model, shard_placement_fn=placement)

    def assert_contiguous(module: nn.Module, args: object) -> None:
        for param in module.parameters():
            case.assertTrue(param.is_contiguous())

    model.in_proj.register_forward_pre_hook(assert_contiguous)
    model.out_proj.register_forward_pre_hook(assert_contiguous)
    for param in model.parameters():
        case.assertTrue(param.is_contiguous())
        case.assertTrue(param.to_local().is_contiguous())
    model(torch.randn((2, 4))).sum().backward()
    for param in model.parameters():
        case.assertTrue(param.is_contiguous())
        case.assertTrue(param.to_local().is_contiguous())
        case.assertTrue(param.grad.is_contiguous())
        case.assertTrue(param.grad.to_local().is_contiguous())


def _rank_contiguous(rank: int, world: int) -> None:
    on_both(torch_case(), _contiguous_params_grads)


@pytest.mark.multiprocess
def test_shard_placement_fn_contiguous_params_grads() -> None:
    """``...::TestFullyShardShardPlacementFnMultiThread::test_shard_placement_fn_contiguous_params_grads``.

    At world 2 (torch: 4).
    """
    run_on_ranks(_rank_contiguous, WORLD)


# ------------------------------------------------------------ tied weights over uneven rows
def _tied_uneven(shard, reshard: bool) -> torch.Tensor:
    case = torch_case()
    hidden, vocab = 16, dist.get_world_size() * 4 + 1

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, hidden)
            self.output = nn.Linear(hidden, vocab, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.output(self.tok_embeddings(ids))

    torch.manual_seed(42)
    model = Tied()
    shard([model.tok_embeddings, model.output], reshard_after_forward=reshard)
    shard(model, reshard_after_forward=reshard)
    model.tok_embeddings.unshard()
    initial = full(model.tok_embeddings.weight)
    model.tok_embeddings.reshard()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    for _ in range(10):
        ids = torch.randint(0, vocab, (2, 8))
        logits = model(ids)
        nn.functional.cross_entropy(logits.view(-1, vocab).float(), ids.view(-1)).backward()
        optim.step()
        optim.zero_grad()
    model.tok_embeddings.unshard()
    final = full(model.tok_embeddings.weight)
    for row in range(vocab):
        case.assertFalse(torch.equal(initial[row], final[row]), f"row {row} not updated")
    model.tok_embeddings.reshard()
    return final


def _rank_tied_uneven(rank: int, world: int) -> None:
    for reshard in (True, False):
        on_both(torch_case(), _tied_uneven, reshard)


@pytest.mark.multiprocess
def test_train_shared_params_uneven_shard() -> None:
    """``...::TestFullyShardSharedParams::test_train_shared_params_uneven_shard`` (2 subtests).

    The weight is read whole (``full_tensor`` where the engine keeps it sharded
    between passes; FSDP2's ``unshard`` registers the whole tensor).
    """
    run_on_ranks(_rank_tied_uneven, WORLD)


# ------------------------------------------------------------ 1F1B micro-batching
def _one_f_one_b(shard, explicit_unshard: bool, reshard_after_backward: bool) -> dict:
    case = torch_case()
    torch.manual_seed(42)
    args = ModelArgs(dropout_p=0.0)
    model = Transformer(args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            shard(module, reshard_after_forward=False)
    shard(model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inps = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(3)]
    if explicit_unshard:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard(async_op=True)
    losses, ref_losses = [], []
    for idx, inp in enumerate(inps):
        last = idx == len(inps) - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(last)
        losses.append(model(inp).sum())
        losses[-1].backward()
        ref_losses.append(ref_model(inp).sum())
        ref_losses[-1].backward()
    _average_grads(ref_model)
    for loss, ref_loss in zip(losses, ref_losses, strict=True):
        case.assertEqual(loss, ref_loss)
    optim.step()
    ref_optim.step()
    check_sharded_parity(case, ref_model, model)
    return {name: full(p) for name, p in model.named_parameters()}


def _rank_1f1b(rank: int, world: int) -> None:
    case = torch_case()
    for explicit, after_backward in itertools.product((False, True), (False, True)):
        on_both(case, _one_f_one_b, explicit, after_backward)


@pytest.mark.multiprocess
def test_1f1b_microbatching() -> None:
    """``...::TestFullyShardGradientAccumulation::test_1f1b_microbatching`` (4 subtests)."""
    run_on_ranks(_rank_1f1b, WORLD)


# ------------------------------------------------------------ a forward method other than forward
class _Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 64, kernel_size=14, stride=14)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class _VisionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.projector = _Vision(), nn.Linear(64, 32)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))


def _custom_forward_method(shard) -> dict:
    case = torch_case()
    torch.manual_seed(42)
    model = _VisionModel()
    ref_model = copy.deepcopy(model)
    shard(model.vit)
    shard(model.projector)
    shard(model)
    register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(4, 3, 56, 56)
    ref_loss, loss = ref_model(inp).sum(), model(inp).sum()
    case.assertEqual(ref_loss, loss)
    ref_loss.backward()
    loss.backward()
    _average_grads(ref_model)
    check_sharded_parity(case, ref_model, model)
    return {name: full(p.grad) for name, p in model.named_parameters()}


def _rank_custom_forward(rank: int, world: int) -> None:
    on_both(torch_case(), _custom_forward_method)


@pytest.mark.multiprocess
def test_register_fsdp_forward_method() -> None:
    """``...::TestFullyShardCustomForwardMethod::test_register_fsdp_forward_method``.

    torch's ViT patch projection at 64 channels on 56x56 images (torch: 1024 on
    224x224) for time; the call path is the same.
    """
    run_on_ranks(_rank_custom_forward, WORLD)


# ------------------------------------------------------------ one rank
def _world_one(shard, lin_shapes) -> list:
    case = torch_case()
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(43)
    inp = torch.randn((4, lin_shapes[0][0]))
    out = []
    for iter_idx in range(10):
        ref_optim.zero_grad(set_to_none=iter_idx % 2 == 0)
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        optim.zero_grad(set_to_none=iter_idx % 2 == 0)
        with CommDebugMode() as comm:
            loss = model(inp).sum()
            loss.backward()
        case.assertEqual(comm.get_total_counts(), 0)
        optim.step()
        case.assertEqual(ref_loss, loss)
        out.append(loss.detach())
    return out


def _rank_world_one(rank: int, world: int) -> None:
    case = torch_case()
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        on_both(case, _world_one, shapes)


@pytest.mark.multiprocess
def test_train_parity_single_worldsize1() -> None:
    """``...::TestFullyShardWorldSize1::test_train_parity_single_worldsize1`` (3 subtests)."""
    run_on_ranks(_rank_world_one, 1)


# ------------------------------------------------------------ set_reduce_scatter_max_input_buffers
def _max_input_buffers(shard) -> list:
    case = torch_case()
    torch.manual_seed(42)
    model = nn.Sequential(MLP(8), MLP(8))
    ref_model = replicated_reference(model)
    for mlp in model:
        shard(mlp)
    shard(model)
    with case.assertRaises(TypeError):
        model.set_reduce_scatter_max_input_buffers(True)
    with case.assertRaises(ValueError):
        model.set_reduce_scatter_max_input_buffers(0)
    model.set_reduce_scatter_max_input_buffers(3)
    model[0].set_reduce_scatter_max_input_buffers(2, recurse=False)
    pairs = [
        (ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1)),
        (model, torch.optim.SGD(model.parameters(), lr=0.1)),
    ]
    torch.manual_seed(1 + dist.get_rank())
    inputs = [torch.randn(4, 8) for _ in range(3)]
    return train_pairs(case, pairs, lambda i: (inputs[i],), 3)


def _rank_max_input_buffers(rank: int, world: int) -> None:
    on_both(torch_case(), _max_input_buffers, torch_needs="set_reduce_scatter_max_input_buffers")


@pytest.mark.multiprocess
def test_set_reduce_scatter_max_input_buffers() -> None:
    """FSDP2's ``set_reduce_scatter_max_input_buffers``: checked as FSDP2 checks, then no-op.

    mf has no copy-in buffer per reduce-scatter (docs/fsdp2.md); the training after
    it is the reference's on both engines.
    """
    run_on_ranks(_rank_max_input_buffers, WORLD)
