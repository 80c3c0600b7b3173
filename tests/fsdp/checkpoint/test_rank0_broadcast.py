"""DSD's ``broadcast_from_rank0=True`` loads into mf's models as into torch's FSDP2.

What accelerate (and so the Hugging Face Trainer) does to resume a
``FULL_STATE_DICT`` checkpoint on several processes: rank 0 holds the full model
and optimizer state dicts, every other rank an empty dict, and
``set_state_dict(..., options=StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` spreads them. A torch FSDP2 model (``fully_shard``
on every layer and the root, AdamW or SGD-momentum) trains 2 steps and gives those
dicts (``get_state_dict`` with ``full_state_dict=True, cpu_offload=True``: rank 0
only). A fresh FSDP2 pair and a fresh mf pair (mf's own ``fully_shard`` under
ZeRO-3, HSDP on a (1, 2) mesh, or ZeRO-1; or mf's FSDP2 front end) load them the
same way: the parameters are equal bit for bit, and the next 2 steps give equal
losses, so the optimizer state came along too. The layers' sizes (7, 9, 5, 11
rows) do not split evenly, so mf's rows differ from ``torch.chunk``'s, as the test
checks before it loads. With ``full_state_dict=True`` alone (every rank holds
the full dicts) the same holds. A tensor of another shape stops every rank with
one error naming the key and both shapes. A key missing from rank 0's dict stops
``strict=True`` naming the key, and ``strict=False`` loads the rest, as FSDP2 does.

Tolerance: parameters bit-exact; losses 1e-6 (the two engines reduce the
gradients in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._state_dict_utils as torch_state_dict_utils
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import mf_fsdp
from mf_fsdp import fsdp2
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import full_params, optimizer_step

TOL = {"rtol": 1e-6, "atol": 1e-6}
VOCAB = 11


class _Odd(nn.Module):
    """A tiny language model whose row counts (11, 7, 9, 5) do not split evenly over 2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.up = nn.Linear(6, 7)
        self.mid = nn.Linear(7, 9)
        self.down = nn.Linear(9, 5)
        self.head = nn.Linear(5, VOCAB)

    def layers(self) -> list[nn.Module]:
        return [self.up, self.mid, self.down, self.head]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers()[:-1]:
            hidden = torch.tanh(layer(hidden))
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _model(seed: int) -> _Odd:
    torch.manual_seed(seed)
    return _Odd()


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":  # momentum: the optimizer state matters
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (3, 4), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    """Train ``steps``; the global loss (mean over the ranks) of each."""
    world = dist.get_world_size()
    return [optimizer_step(model(*_batch(step, rank)), opt, world) for step in steps]


def _fsdp2_pair(opt_name: str, seed: int, shard=fully_shard):
    """``_Odd`` under torch's ``fully_shard`` (or mf's front end), the optimizer built after."""
    module = _model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in module.layers():
        shard(layer, mesh=mesh)
    shard(module, mesh=mesh)
    return module, _optimizer(opt_name, module.parameters())


def _mf_pair(opt_name: str, seed: int, layout: str):
    """``_Odd`` under mf's own ``fully_shard``: ZeRO-3, HSDP on a (1, world) mesh, or ZeRO-1."""
    module = _model(seed)
    kwargs: dict = {"zero_dp_strategy": 1 if layout == "zero1" else 3}
    if layout == "hsdp":
        mesh = cpu_mesh((1, dist.get_world_size()), ("dp_outer", "dp_shard"))
        kwargs |= {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    return mf_fsdp.fully_shard(
        module, _optimizer(opt_name, module.parameters()), fsdp_unit_modules=[nn.Linear], **kwargs
    )


def _pair(engine: str, opt_name: str, seed: int):
    if engine == "mf-fsdp2":
        return _fsdp2_pair(opt_name, seed, fsdp2.fully_shard)
    return _mf_pair(opt_name, seed, engine.removeprefix("mf-"))


def _local_rows(model: nn.Module) -> dict[str, int]:
    """Each parameter's rows on this rank (FSDP2's are torch.chunk's)."""
    return {
        name: p.to_local().shape[0] if isinstance(p, DTensor) else p.shape[0]
        for name, p in model.named_parameters()
    }


def _rank_loads_like_fsdp2(
    rank: int, world: int, engine: str, opt_name: str, broadcast: bool, cpu_offload: bool
) -> None:
    trained, trained_opt = _fsdp2_pair(opt_name, seed=0)
    _steps(trained, trained_opt, rank, range(2))
    # broadcast_from_rank0 as accelerate: the full dicts on rank 0 only (cpu_offload=True
    # keeps them there); without it, on every rank.
    saved = StateDictOptions(full_state_dict=True, cpu_offload=broadcast)
    model_sd, optim_sd = get_state_dict(trained, trained_opt, options=saved)
    assert bool(model_sd) == (rank == 0 or not broadcast)
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast, cpu_offload=cpu_offload, strict=True
    )
    results = {}
    for name, (model, opt) in (
        ("fsdp2", _fsdp2_pair(opt_name, seed=1)),
        (engine, _pair(engine, opt_name, seed=1)),
    ):
        results[name] = (model, opt, _local_rows(model))
        # Model, then optimizer, as accelerate loads them: set_state_dict would take the
        # empty model dict of ranks > 0 for "optimizer only" and load the model on rank 0
        # alone. Each load gets its own copies: DSD pops entries off the dicts it is
        # given, and the loaded optimizers keep Adam's 0-d step tensors as they are.
        set_model_state_dict(model, copy.deepcopy(model_sd), options=options)
        set_optimizer_state_dict(model, opt, copy.deepcopy(optim_sd), options=options)
    if engine != "mf-zero1":  # ZeRO-1 parameters are whole (its optimizer state is not)
        rows = [results[name][2] for name in ("fsdp2", engine)]
        assert rows[0] != rows[1], f"{engine}'s rows are torch.chunk's: the test shows nothing"
    expected = full_params(results["fsdp2"][0])
    for name, value in full_params(results[engine][0]).items():
        assert torch.equal(value, expected[name]), f"{engine} {name}"
    losses = {
        name: _steps(model, opt, rank, range(2, 4)) for name, (model, opt, _) in results.items()
    }
    torch.testing.assert_close(losses[engine], losses["fsdp2"], **TOL)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["mf-zero3", "mf-fsdp2", "mf-hsdp", "mf-zero1"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_broadcast_from_rank0_loads_like_fsdp2(engine: str, opt_name: str) -> None:
    # AdamW's run also offloads to the CPU, as accelerate asks (a no-op on a CPU run).
    run_on_ranks(
        _rank_loads_like_fsdp2, 2, engine, opt_name, True, opt_name == "adamw", timeout=200
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["mf-zero3", "mf-fsdp2"])
def test_full_state_dict_on_every_rank_still_loads(engine: str) -> None:
    run_on_ranks(_rank_loads_like_fsdp2, 2, engine, "adamw", False, False, timeout=200)


def _rank_shape_mismatch(rank: int, world: int, engine: str) -> None:
    model, _ = _pair(engine, "sgd", seed=1)
    full = _model(0).state_dict()
    full["mid.weight"] = torch.zeros(10, 7)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(RuntimeError) as raised:
        set_model_state_dict(model, full if rank == 0 else {}, options=options)
    message = str(raised.value)
    for part in ("mid.weight", "(10, 7)", "(9, 7)"):
        assert part in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["mf-zero3", "mf-fsdp2"])
def test_broadcast_of_another_shape_names_the_key(engine: str) -> None:
    run_on_ranks(_rank_shape_mismatch, 2, engine, timeout=90)


def _rank_strict(rank: int, world: int, engine: str) -> None:
    """A key missing from rank 0's dict: ``strict=False`` loads the rest as FSDP2 does."""
    full = _model(0).state_dict()
    del full["head.bias"]
    loaded = {}
    for name, (model, _) in (("fsdp2", _fsdp2_pair("sgd", 1)), (engine, _pair(engine, "sgd", 1))):
        for strict in (True, False):
            options = StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=strict
            )
            sd = copy.deepcopy(full) if rank == 0 else {}
            if strict:
                with pytest.raises(RuntimeError, match="head.bias"):
                    set_model_state_dict(model, sd, options=options)
            else:
                set_model_state_dict(model, sd, options=options)
        loaded[name] = full_params(model)
    kept = full_params(_model(1))["head.bias"]  # the missing key keeps the fresh model's value
    for key, value in loaded["fsdp2"].items():
        assert torch.equal(loaded[engine][key], value), key
        assert torch.equal(value, kept if key == "head.bias" else full[key]), key


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["mf-zero3", "mf-fsdp2"])
def test_strict_reports_a_missing_key_and_non_strict_loads_the_rest(engine: str) -> None:
    run_on_ranks(_rank_strict, 2, engine, timeout=90)


def _rank_wraps_once(rank: int, world: int) -> None:
    torch_distribute = torch_state_dict_utils._distribute_tensors
    _pair("mf-fsdp2", "sgd", seed=0)
    wrapped = torch_state_dict_utils._distribute_tensors
    assert wrapped is not torch_distribute
    assert wrapped.__wrapped__ is torch_distribute
    _pair("mf-zero3", "sgd", seed=0)
    assert torch_state_dict_utils._distribute_tensors is wrapped


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_torch_function_exists_and_is_wrapped_once() -> None:
    """The torch function the load rests on is still there, and building engines wraps it once.

    Should a torch release rename ``_state_dict_utils._distribute_tensors``, this
    fails first (the loads above fail too, with torch's size mismatch).
    """
    run_on_ranks(_rank_wraps_once, 2, timeout=90)
