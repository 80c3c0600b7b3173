"""Parameters of several dtypes in one ``fully_shard`` unit, on torch's FSDP2 and on mf.

torch's ``TestFullyShardMixedDtypeParam::test_mixed_dtypes_no_grad_param`` puts a
frozen fp8 parameter beside a trainable fp32 one in one unit; the common real
case is LoRA (frozen bf16 bases, fp32 adapters, one layer). FSDP2 keeps each
parameter's own dtype: sharded, gathered and stepped in it. Each scenario here
runs on both engines in the same gloo ranks (``on_both``): the gathered values
seen inside the forward equal the originals bit for bit, the frozen parameters
stay unchanged, and losses, gradients and weights over several SGD and AdamW
steps equal a one-process reference and torch's FSDP2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp import fsdp2
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, torch_case
from tests.fsdp._fsdp2_port_common import full, on_both

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")

DIM = 16


class _LoraLinear(nn.Module):
    """A frozen base weight in ``base_dtype`` with trainable fp32 adapters and bias.

    ``adapter_dtype`` other than fp32 makes a trainable parameter of a third dtype
    too (the "any mix" case). Every forward records the base weight it computed
    with (the gathered value) in ``seen``.
    """

    def __init__(self, base_dtype: torch.dtype, adapter_dtype: torch.dtype) -> None:
        super().__init__()
        base = torch.randn(DIM, DIM).to(base_dtype)
        self.base = nn.Parameter(base, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(4, DIM) * 0.1)
        self.lora_b = nn.Parameter((torch.randn(DIM, 4) * 0.1).to(adapter_dtype))
        self.bias = nn.Parameter(torch.zeros(DIM))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.base.detach().clone())
        dtype = x.dtype  # fp32, or a policy's param_dtype (cast_forward_inputs)
        out = x @ self.base.to(dtype).t() + self.bias.to(dtype)
        return out + (x @ self.lora_a.to(dtype).t()) @ self.lora_b.to(dtype).t()


def _model(base_dtype: torch.dtype, adapter_dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_LoraLinear(base_dtype, adapter_dtype) for _ in range(2)))


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW, multi-tensor on every engine and the reference.

    (torch's CPU loop and multi-tensor SGD round bf16 weights differently; mf
    steps with the multi-tensor kernels where the choice is left to it.)
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)  # type: ignore[arg-type]


def _train(
    shard,
    base_dtype: torch.dtype,
    adapter_dtype: torch.dtype,
    optim: str,
    param_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Four steps on every rank's equal batch; equal to one process, frozen bases unchanged.

    With ``param_dtype`` (FSDP2's policy: compute in it, keep each shard's dtype)
    the one-process reference computes otherwise, so only the other engine's
    values are compared (by ``on_both``) besides the frozen bases.

    Returns the losses, the last step's whole gradients and the whole weights,
    for the comparison with the other engine. The frozen bases are checked
    where the forward sees them: each forward's gathered value, after every step.
    """
    case = torch_case()
    ref, model = _model(base_dtype, adapter_dtype), _model(base_dtype, adapter_dtype)
    originals = [layer.base.detach().clone() for layer in ref]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model:
        shard(layer, mp_policy=policy)
    shard(model, mp_policy=policy)
    exact = param_dtype is None
    ref_optim = _optimizer(optim, [p for p in ref.parameters() if p.requires_grad])
    optimizer = _optimizer(optim, [p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(1)  # the same batch on every rank: the mean is the one-process grad
    losses = []
    for _ in range(4):
        x = torch.randn(8, DIM)
        for net, opt in ((ref, ref_optim), (model, optimizer)):
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
        losses.append(loss.detach())
        if exact:
            case.assertEqual(model(x).square().mean(), ref(x).square().mean())
    for layer, original in zip(model, originals, strict=True):
        case.assertTrue(all(s.dtype == base_dtype for s in layer.seen))
        case.assertTrue(all(torch.equal(s.float(), original.float()) for s in layer.seen))
        case.assertIsNone(layer.base.grad)
    named = dict(ref.named_parameters())
    grads, weights = [], []
    for name, param in model.named_parameters():
        if param.element_size() == 1:  # full_tensor() of fp8 fails in gloo (both engines):
            continue  # its gathered value is checked in every forward above
        whole = full(param)
        assert whole is not None
        case.assertEqual(whole.dtype, named[name].dtype, msg=name)
        if exact:
            case.assertEqual(whole.float(), named[name].detach().float(), msg=name)
        weights.append(whole.float())
        if param.requires_grad:
            grad = full(param.grad)
            assert grad is not None
            case.assertEqual(grad.dtype, param.dtype, msg=name)
            grads.append(grad.float())
    last = model(x).square().mean().detach()
    state = model.state_dict()  # each entry in its parameter's own dtype; loads back
    case.assertEqual({k: v.dtype for k, v in state.items()}, {k: v.dtype for k, v in named.items()})
    model.load_state_dict(state)
    case.assertEqual(model(x).square().mean(), last)
    return losses, grads, weights


def _torch_no_grad_param(shard, world: int) -> None:
    """torch's test body: a frozen fp8 parameter beside an fp32 one; a forward using neither."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_fp8 = nn.Parameter(
                torch.empty((256, 256), dtype=torch.float8_e4m3fn), requires_grad=False
            )
            self.w_fp32 = nn.Parameter(torch.empty((256, 256), dtype=torch.float32))

        def forward(self, inp: object) -> None:
            return None

    from torch.distributed.device_mesh import init_device_mesh

    model = Model()
    shard(model, mesh=init_device_mesh("cpu", (world,)))
    model(0)


CASES = (
    (torch.float8_e4m3fn, torch.float32),  # torch's test: a frozen fp8 beside fp32
    (torch.bfloat16, torch.float32),  # LoRA: frozen bf16 bases, fp32 adapters
)


def _rank_mixed_dtypes(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _torch_no_grad_param, world)
    for base_dtype, adapter_dtype in CASES:
        for optim in ("sgd", "adamw"):
            on_both(case, _train, base_dtype, adapter_dtype, optim)
    on_both(case, _train, torch.bfloat16, torch.float32, "adamw", torch.bfloat16)  # QLoRA-like
    # Trainable parameters of two dtypes (bf16 and fp32) in one unit: torch's FSDP2
    # refuses them at its first forward; mf serves them (one bucket per dtype),
    # checked against the one-process reference alone.
    with case.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
        _train(torch_fully_shard, torch.bfloat16, torch.bfloat16, "sgd")
    for optim in ("sgd", "adamw"):
        on_both(case, _train, torch.bfloat16, torch.bfloat16, optim, torch_runs=False)
    # A trainable fp8 parameter: its gradients would be reduced in fp8; one line naming it.
    with case.assertRaisesRegex(NotImplementedError, "parameter 0.lora_b is torch.float8_e4m3fn"):
        _train(fsdp2.fully_shard, torch.bfloat16, torch.float8_e4m3fn, "sgd")


@pytest.mark.multiprocess
def test_mixed_dtypes_in_one_unit_match_torch() -> None:
    """torch's mixed-dtype test, frozen bf16 / fp8 bases by fp32 adapters, a trainable mix."""
    run_on_ranks(_rank_mixed_dtypes, WORLD)
