"""Eager optimizer state: created at once, yet the training is a fresh optimizer's, bit for bit.

``init_optimizer_state`` (what ``fully_shard_optimizer`` runs) creates every
parameter's state with a zero-gradient, zero-lr step and puts back what that
step moved (step counters, NAdam's ``mu_product``, ...). For each of torch's
optimizers, a model trained with the eagerly created state must end exactly
where the same model trained from lazily created state ends. One process, no
process group: the function only touches the optimizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mf_fsdp.optim.state import drop_unused_initial_state, init_optimizer_state

OPTIMIZERS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "nesterov": False}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("AdamW", {"lr": 0.01}),
    ("NAdam", {"lr": 0.01}),
    ("RAdam", {"lr": 0.01}),
    ("Adamax", {"lr": 0.01}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Adadelta", {"lr": 0.5}),
    ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),
    ("ASGD", {"lr": 0.01}),
    ("Rprop", {"lr": 0.01}),
]


def _train(eager: bool, name: str, options: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = getattr(torch.optim, name)(model.parameters(), **options)
    if eager:
        optimizer.register_step_pre_hook(lambda opt, a, k: drop_unused_initial_state(opt))
        init_optimizer_state(optimizer)
        assert len(optimizer.state) == (0 if name == "SGD" and "momentum" not in options else 4)
        assert all(p.grad is None for p in model.parameters())
        assert optimizer.param_groups[0]["lr"] == options["lr"]
    inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        loss = model(inputs[4 * step : 4 * step + 4]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("name", "options"), OPTIMIZERS, ids=lambda v: str(v))
def test_eager_state_trains_like_lazy_state(name: str, options: dict) -> None:
    for eager, lazy in zip(_train(True, name, options), _train(False, name, options), strict=True):
        assert torch.equal(eager, lazy)


def test_loaded_state_is_kept_and_an_existing_state_untouched() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    init_optimizer_state(optimizer)
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    init_optimizer_state(optimizer)  # a no-op once there is state
    assert optimizer.state[model.weight]["momentum_buffer"] is buffer
