"""torchtitan's own ``parallelize_llama`` with its ``fully_shard`` swapped for mf's.

torchtitan applies FSDP2 in ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``
(called by the Llama 3 ``parallelize_llama``), which reads ``fully_shard`` from its
own module globals. Replacing that one name with ``mf_fsdp.fsdp2.fully_shard``
runs torchtitan's wrapping unchanged on mf's engine: the token embedding, the
``[norm, lm_head]`` group and every block as units, then the root; its mixed
precision policy (``cast_forward_inputs=False``), its reshard policy, and its
``disable_fsdp_gradient_division`` (``set_gradient_divide_factor(1.0)`` on every
FSDP module, root first), so the loss is divided by the world as torchtitan's
global token count does.

The model is torchtitan's Llama 3 debugmodel as in ``test_torchtitan_llama`` (SDPA
attention for the CPU), built on the meta device, parallelized, then ``to_empty``
and torchtitan's ``init_weights``. Checked at world 2 (fp32 also at 4):

- fp32: 5 AdamW steps give the losses of one process on the global batch;
- torchtitan's chunked loss (``ChunkedLossWrapper``: the model stops before
  ``lm_head``, which the loss calls once per chunk with a backward each, its
  gradient sync off until the last chunk, gathered throughout by ``unshard``
  and ``set_reshard_after_*(False)``, then ``reshard``; the decoder's backward
  after): 4 AdamW steps give one process's losses, and torch's FSDP2 on the same
  path gives the same losses;
- bf16 compute (``mixed_precision_param="bfloat16"``): the losses of torch's own
  ``fully_shard`` through the same torchtitan function from the same initial
  weights, within 1e-2;
- torchtitan's per-block compile (``compile_config``, blocks compiled before its
  FSDP calls, ``fullgraph=True``): 3 steps equal to eager within 1e-4;
- the checkpoint: mf's front end saves its ``state_dict()`` with DCP, and torch's
  FSDP2 model from the same function loads it (DCP, then ``load_state_dict``) and
  trains on identically. (DSD's ``get_model_state_dict`` refuses this model under
  either engine: torchtitan's fused QKV state-dict keys are no module attributes.)
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from mf_fsdp import fsdp2
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.integration.test_torchtitan_llama import _config, _initialised  # skips where it does

try:
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete")
# The ranks import this module (their functions are its), and so torchtitan: seconds of
# CPU per rank, which the forkserver pays once instead (torchtitan imported: no skip here).
preload_in_ranks(__name__)

VOCAB, SEQ, BATCH, STEPS = 2048, 32, 2, 5


def sharded_dims(ep: int) -> ParallelDims:
    """torchtitan's ``ParallelDims`` sharding every rank's data (``dp_shard=world``), ``ep``."""
    world = dist.get_world_size()
    return ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=ep,
        world_size=world,
        spmd_backend="partial_dtensor",
    )


def _parallelized(shard, param_dtype: str, tmp: str, seed: int = 0, compile_blocks: bool = False):
    """torchtitan's ``parallelize_llama`` on a meta model, ``fully_shard`` being ``shard``.

    The one line a torchtitan user changes is the patched name; the rest is
    torchtitan's (its ``ParallelDims`` mesh, with the CPU as the device type).
    """
    dims = sharded_dims(ep=1)
    with torch.device("meta"):
        model = _config().build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ):
        dims.build_mesh()
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=param_dtype),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(enable=compile_blocks, components=["model"]),
            ac_config=None,
            dump_folder=tmp,
        )
    assert isinstance(model, TorchFSDPModule)
    assert isinstance(model.layers["0"], TorchFSDPModule)
    if shard is torch_fully_shard:  # gloo has no PREMUL_SUM, which factor 1.0 asks of torch
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return _initialised(model, seed)


def _plain():
    with torch.device("meta"):
        model = _config().build()
    return _initialised(model)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    """torchtitan's scaling: FSDP's division is off, so each rank's loss is over ``world``."""
    losses = []
    for step in steps:
        loss = _loss(model, *_batch(step, rank)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _reference(world: int, steps: range) -> list[float]:
    """One process on the global batch (each rank's part over ``world``)."""
    model = _plain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in steps:
        total = 0.0
        for rank in range(world):
            loss = _loss(model, *_batch(step, rank)) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _rank_fp32(rank: int, world: int, tmp: str) -> None:
    model = _parallelized(fsdp2.fully_shard, "float32", tmp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    losses = _train(model, opt, rank, world, range(STEPS))
    torch.testing.assert_close(losses, _reference(world, range(STEPS)), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_torchtitan_parallelize_on_mf_trains_like_one_process(tmp_path, world: int) -> None:
    run_on_ranks(_rank_fp32, world, str(tmp_path), timeout=280)


def _train_chunked(model, rank: int, world: int, steps: range) -> list[float]:
    """torchtitan's chunked loss: the trainer's ``_skip_lm_head`` and the loss's chunks."""
    loss_fn = ChunkedLossWrapper.Config(num_chunks=4).build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    global_tokens = torch.tensor(float(BATCH * SEQ * world))
    losses = []
    for step in steps:
        tokens, targets = _batch(step, rank)
        loss, _ = loss_fn(model(tokens), targets, global_tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _rank_chunked(rank: int, world: int, tmp: str) -> None:
    runs = {}
    for name, shard in (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = _parallelized(shard, "float32", tmp)
        if shard is torch_fully_shard:
            _copy_one_process_initialised(model)
        assert isinstance(model.lm_head, TorchFSDPModule)  # the loss takes its FSDP path
        runs[name] = _train_chunked(model, rank, world, range(4))
    reference = _reference(world, range(4))
    torch.testing.assert_close(runs["mf"], reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["mf"], runs["torch"], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchtitan_chunked_loss_on_mf_trains_like_one_process(tmp_path) -> None:
    run_on_ranks(_rank_chunked, 2, str(tmp_path), timeout=280)


def _copy_one_process_initialised(model) -> None:
    """Give torch's FSDP2 model one process's initial weights.

    torchtitan's ``init_weights`` on FSDP2's sharded DTensors draws other values than
    one process does (DTensor's own random ops); mf's engine draws one process's.
    """
    plain = _plain()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = plain.get_parameter(name)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))


def _rank_bf16(rank: int, world: int, tmp: str) -> None:
    runs = {}
    for name, shard in (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = _parallelized(shard, "bfloat16", tmp)
        if shard is torch_fully_shard:
            _copy_one_process_initialised(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = _train(model, opt, rank, world, range(STEPS))
    torch.testing.assert_close(
        torch.tensor(runs["mf"]), torch.tensor(runs["torch"]), rtol=1e-2, atol=0.0
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchtitan_parallelize_bf16_matches_torch_fsdp2(tmp_path) -> None:
    run_on_ranks(_rank_bf16, 2, str(tmp_path), timeout=280)


def _rank_checkpoint(rank: int, world: int, tmp: str) -> None:
    """Saved by DCP from mf's front end; loaded by DCP into torch's FSDP2 model."""
    path = str(Path(tmp) / "ckpt")
    mf_model = _parallelized(fsdp2.fully_shard, "float32", tmp)
    mf_opt = torch.optim.AdamW(mf_model.parameters(), lr=1e-3)
    _train(mf_model, mf_opt, rank, world, range(2))
    dcp.save(mf_model.state_dict(), checkpoint_id=path)

    torch_model = _parallelized(torch_fully_shard, "float32", tmp, seed=1)
    state = torch_model.state_dict()
    dcp.load(state, checkpoint_id=path)
    torch_model.load_state_dict(state)
    for name, value in mf_model.state_dict().items():
        got = state[name]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        want = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(got, want), name
    # The same next step from the same weights (SGD: no optimizer state to carry).
    losses = []
    for model in (mf_model, torch_model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append(_train(model, opt, rank, world, range(2, 4)))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_mf_checkpoint_loads_into_torch_fsdp2_through_dcp(tmp_path) -> None:
    run_on_ranks(_rank_checkpoint, 2, str(tmp_path), timeout=280)


def _titan_optimizers(model) -> OptimizersContainer:
    """torchtitan's optimizer container (AdamW on every parameter, FQN-keyed state)."""
    every = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    config = OptimizersContainer.Config(param_groups=[every], implementation="foreach")
    return OptimizersContainer(config, model_parts=[model])


def _titan_states(model, optimizers: OptimizersContainer) -> tuple[ModelWrapper, dict]:
    """What torchtitan's ``CheckpointManager`` gives DCP: the model's flat state dict
    beside the optimizers' (``Stateful``) entry."""
    wrapper = ModelWrapper(model)
    return wrapper, {"optimizer": optimizers, **wrapper.state_dict()}


def _rank_resume(rank: int, world: int, tmp: str) -> None:
    """Saved through torchtitan's checkpoint wrappers by one engine, resumed by the other.

    The resumed model starts from other weights and an empty optimizer: only what
    was loaded makes its next AdamW steps equal to the run that went on.
    """
    engines = {"mf": fsdp2.fully_shard, "torch": torch_fully_shard}
    for saver, loader in (("mf", "mf"), ("mf", "torch"), ("torch", "mf")):
        path = str(Path(tmp) / f"{saver}-to-{loader}")
        model = _parallelized(engines[saver], "float32", tmp)
        optimizers = _titan_optimizers(model)
        _train(model, optimizers, rank, world, range(2))
        dcp.save(_titan_states(model, optimizers)[1], checkpoint_id=path)
        went_on = _train(model, optimizers, rank, world, range(2, 4))

        resumed = _parallelized(engines[loader], "float32", tmp, seed=1)
        resumed_optimizers = _titan_optimizers(resumed)
        wrapper, states = _titan_states(resumed, resumed_optimizers)
        dcp.load(states, checkpoint_id=path)
        wrapper.load_state_dict(states)
        resumed_losses = _train(resumed, resumed_optimizers, rank, world, range(2, 4))
        torch.testing.assert_close(
            resumed_losses, went_on, rtol=1e-5, atol=1e-6, msg=f"{saver} -> {loader}"
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torchtitan_checkpoints_resume_across_mf_and_torch_fsdp2(tmp_path) -> None:
    run_on_ranks(_rank_resume, 2, str(tmp_path), timeout=380)


def _rank_compiled(rank: int, world: int, tmp: str) -> None:
    """torchtitan's per-block compile (before its FSDP calls) trains as eager does."""
    torch._dynamo.reset()
    runs = []
    for compile_blocks in (False, True):
        model = _parallelized(fsdp2.fully_shard, "float32", tmp, compile_blocks=compile_blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs.append(_train(model, opt, rank, world, range(3)))
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torchtitan_per_block_compile_on_mf_trains_like_eager(tmp_path) -> None:
    run_on_ranks(_rank_compiled, 2, str(tmp_path), timeout=380)
