"""Bad sizes and a config for another TP size: the layer constructors say which argument.

Sizes are checked before the TP group is looked up, so those tests need no
process group. The config-versus-group check runs on two gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mf_tp
from tests._multiprocess import run_on_ranks

_INIT = torch.nn.init.normal_


def _column(input_size: Any, output_size: Any, **kwargs: Any) -> torch.nn.Module:
    return mf_tp.ColumnParallelLinear(input_size, output_size, init_method=_INIT, **kwargs)


def _row(input_size: Any, output_size: Any, **kwargs: Any) -> torch.nn.Module:
    return mf_tp.RowParallelLinear(
        input_size,
        output_size,
        init_method=_INIT,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        **kwargs,
    )


def _embedding(num_embeddings: Any, embedding_dim: Any, **kwargs: Any) -> torch.nn.Module:
    return mf_tp.VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=_INIT, **kwargs)


def _inference_column(input_size: Any, output_size: Any, **kwargs: Any) -> torch.nn.Module:
    return mf_tp.InferenceLayerNormColumnParallelLinear(
        input_size,
        output_size,
        init_method=_INIT,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
        **kwargs,
    )


LAYERS: list[tuple[str, Callable[..., torch.nn.Module], tuple[str, str]]] = [
    ("ColumnParallelLinear", _column, ("input_size", "output_size")),
    ("RowParallelLinear", _row, ("input_size", "output_size")),
    ("VocabParallelEmbedding", _embedding, ("num_embeddings", "embedding_dim")),
    ("InferenceLayerNormColumnParallelLinear", _inference_column, ("input_size", "output_size")),
]


@pytest.mark.parametrize(("name", "build", "arguments"), LAYERS, ids=[n for n, *_ in LAYERS])
@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("bad", [-4, 0, 4.0, True, "8"])
def test_sizes_must_be_positive_ints(name, build, arguments, position, bad) -> None:
    sizes = [8, 8]
    sizes[position] = bad
    match = rf"{name}: {arguments[position]} must be a positive int, got {bad!r}"
    with pytest.raises(ValueError, match=match):
        build(*sizes, config=mf_tp.ModelParallelConfig())


def test_embedding_config_type() -> None:
    with pytest.raises(TypeError, match="VocabParallelEmbedding: config must be a ModelParallel"):
        _embedding(8, 4, config={"tensor_model_parallel_size": 1})


def _rank_config_for_another_tp_size(rank: int, world: int) -> None:
    group = dist.group.WORLD
    wrong = mf_tp.ModelParallelConfig(tensor_model_parallel_size=4, use_cpu_initialization=True)
    right = mf_tp.ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    for name, build, _ in LAYERS:
        match = (
            rf"{name}: config.tensor_model_parallel_size=4 but the tensor-parallel group "
            rf"\(tp_group\) has {world} ranks; expected them equal"
        )
        with pytest.raises(ValueError, match=match):
            build(8, 8, config=wrong, tp_group=group)
        build(8, 8, config=right, tp_group=group)  # the same layer with a matching config
    # The default group (tp_group=None) is checked the same way.
    mf_tp.initialize_model_parallel(world)
    try:
        with pytest.raises(ValueError, match=r"tensor_model_parallel_size=1 but .* has 2 ranks"):
            _column(8, 8, config=mf_tp.ModelParallelConfig())
        _column(8, 8, config=right)
    finally:
        mf_tp.destroy_model_parallel()
    # Expert layers run on the expert-TP group, whose size the config does not record.
    _column(8, 8, config=wrong, tp_group=group, is_expert=True)


@pytest.mark.multiprocess
def test_config_for_another_tp_size() -> None:
    run_on_ranks(_rank_config_for_another_tp_size, 2, timeout=120)
