"""Expert tensor parallelism in ``mf_tp.MoELayer``: each expert's FFN split over an ETP group.

On 2 ranks as one ETP group, the layer (``fc`` by columns, ``out`` by rows, ``out_bias``
by ``H``) must give every rank the output, input gradient and router gradient one process
gives for that rank's tokens, and each ETP share of every expert weight the gradient of
both ranks' tokens (no reduction over ETP left to do). The batches route unevenly
(``tests/tp/test_moe.py``'s: one expert gets no token, rank 0 none for half the experts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import mf_tp
from tests._multiprocess import run_on_ranks
from tests.tp.test_moe import (
    FFN,
    HIDDEN,
    NUM_EXPERTS,
    SEED,
    TOP_K,
    _batch,
    _close,
    _forward_and_loss,
    _reference_run,
    _router_weight,
)


def _layer(etp_group: dist.ProcessGroup | None) -> mf_tp.MoELayer:
    torch.manual_seed(SEED)
    layer = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K, etp_group=etp_group)
    with torch.no_grad():
        layer.router.weight.copy_(_router_weight())
    gen = torch.Generator().manual_seed(SEED)
    shapes = {"fc.weight": (FFN, HIDDEN), "fc.bias": (FFN,), "out.weight": (HIDDEN, FFN)}
    shapes["out.bias"] = (HIDDEN,)  # random biases: a misplaced slice of one shows
    drawn = [
        {k: 0.1 * torch.randn(shape, generator=gen) for k, shape in shapes.items()}
        for _ in range(NUM_EXPERTS)
    ]
    layer.experts.load_initial_weights(drawn)
    return layer


def _rank_etp_parity(rank: int, world: int) -> None:
    layer, reference = _layer(dist.group.WORLD), _layer(None)
    experts = layer.experts
    assert experts.fc_weight.placements == (Shard(1),)  # columns: F
    assert experts.out_weight.placements == (Shard(2),)  # rows: F
    assert experts.out_bias.to_local().shape == (NUM_EXPERTS, HIDDEN // world)
    for name, value in layer.state_dict().items():  # parameter-shaped: the whole experts
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full, reference.state_dict()[name]), name

    expected, expected_expert_grads = _reference_run(reference, rank, world)
    x, g = _batch(rank, world)
    for needs_grad in (True, rank != 0):  # a rank without input grads joins the exchanges
        layer.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_(needs_grad)
        out, loss = _forward_and_loss(layer, x, g)
        _close(out, expected["out"], "output")
        loss.backward()
        if needs_grad:
            _close(x.grad, expected["x.grad"], "input gradient")
        _close(layer.router.weight.grad, expected["router.grad"], "router gradient")
        for name, param in layer.named_parameters():
            if name.startswith("experts."):
                grad = param.grad.full_tensor()
                _close(grad, expected_expert_grads[name], f"gradient of {name}")

    match = r"ffn_hidden_size 25 is not divisible by the expert-TP \(ETP\) size 2"
    with pytest.raises(ValueError, match=match):
        mf_tp.MoELayer(HIDDEN, 25, NUM_EXPERTS, TOP_K, etp_group=dist.group.WORLD)


@pytest.mark.multiprocess
def test_expert_tensor_parallel_layer_matches_one_process() -> None:
    run_on_ranks(_rank_etp_parity, 2, timeout=60)
