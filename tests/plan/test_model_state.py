"""mf-plan's model-state bytes per rank against what the engine then holds on real ranks.

The planner builds the engine on the meta device at world N on a fake process
group (``mf.plan.model_state``); here the same tiny GPT is trained one step on
two and on four real gloo ranks, sharded by mf-train's own call, and each rank's
``memory_footprint`` at the optimizer step must equal the prediction byte for
byte, for ZeRO 0 to 3, AdamW and SGD with momentum, bf16 and fp32 compute,
HSDP replicas and a dp x cp group.
"""

from __future__ import annotations

import pytest
import torch

from mf.models import GPT, PRESETS, Block
from mf.plan import plan_model_state
from mf.plan.meta_model import model_source
from mf.train.rank.setup import shard_module, train_mesh
from tests._multiprocess import run_on_ranks

_CASES = {  # (zero, optimizer, precision, dp_outer, cp)
    2: [
        (0, "adamw", "bf16", 1, 1),
        (1, "adamw", "bf16", 1, 1),
        (1, "sgd", "fp32", 1, 1),
        (2, "sgd", "bf16", 1, 1),
        (2, "adamw", "fp32", 1, 1),
        (3, "adamw", "bf16", 1, 1),
        (3, "sgd", "bf16", 1, 1),
    ],
    # Four ranks on two cores: a few cases, HSDP (two replicas) and the dp x cp group among them.
    4: [
        (1, "sgd", "bf16", 1, 1),
        (3, "adamw", "bf16", 1, 1),
        (3, "adamw", "bf16", 2, 1),
        (2, "adamw", "bf16", 1, 2),
    ],
}
_KEYS = ("params", "main_params", "grads", "optimizer_state")


def _optimizer(name: str, module: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)


def _rank_measure(rank: int, world: int, predicted: list[list[dict[str, int]]]) -> None:
    wrong = []
    for case, expected in zip(_CASES[world], predicted, strict=True):
        zero, name, precision, dp_outer, cp = case
        mesh = train_mesh("cpu", world, tp=1, cp=cp, dp_outer=dp_outer)
        torch.manual_seed(0)
        module = GPT(PRESETS["tiny"])
        optimizer = _optimizer(name, module)
        model, (optimizer,) = shard_module(
            module, [optimizer], mesh, [Block], zero=zero, precision=precision
        )
        # Each rank trains on whole sequences, cp or not: the model state does not depend on it.
        tokens = torch.randint(0, 256, (2, 17))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()  # the grads are held until zero_grad: the step's model state
        held = model.memory_footprint(optimizer)
        measured = {key: held[key] for key in _KEYS}
        if measured != expected[rank]:
            wrong.append(f"{case}: planned {expected[rank]}, held {measured}")
    assert not wrong, "\n".join(wrong)


def _predicted(world: int) -> list[list[dict[str, int]]]:
    """For each case of ``world``, each rank's planned bytes (on this process's fake group)."""
    source = model_source("tiny")
    planned = []
    for zero, name, precision, dp_outer, cp in _CASES[world]:
        per_rank = []
        for rank in range(world):
            state = plan_model_state(
                source,
                world,
                zero=zero,
                precision=precision,
                cp=cp,
                dp_outer=dp_outer,
                optimizer=name,
                rank=rank,
            )
            per_rank.append({key: getattr(state, key) for key in _KEYS})
        planned.append(per_rank)
    return planned


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", sorted(_CASES))
def test_planned_model_state_is_what_the_engine_holds(world: int) -> None:
    run_on_ranks(_rank_measure, world, _predicted(world), timeout=240)
