"""Strategy normalisation, policies and config validation (no process group)."""

from __future__ import annotations

import pytest
import torch

from mf_fsdp import (
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    ZeroDPStrategy,
    normalize_strategy,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, ZeroDPStrategy.NO_SHARD),
        (1, ZeroDPStrategy.OPTIM),
        (2, ZeroDPStrategy.OPTIM_GRADS),
        (3, ZeroDPStrategy.OPTIM_GRADS_PARAMS),
        ("no_shard", ZeroDPStrategy.NO_SHARD),
        ("optim_grads_params", ZeroDPStrategy.OPTIM_GRADS_PARAMS),
        (ZeroDPStrategy.OPTIM, ZeroDPStrategy.OPTIM),
    ],
)
def test_normalize_strategy(value, expected) -> None:
    assert normalize_strategy(value) is expected
    assert expected.level == [*ZeroDPStrategy].index(expected)


@pytest.mark.parametrize("value", [4, -1, "zero3", True, None, 2.0])
def test_unknown_strategy_names_value_and_choices(value) -> None:
    with pytest.raises(ValueError, match=rf"zero_dp_strategy: unknown strategy {value!r}.*'optim'"):
        normalize_strategy(value)


def test_ddp_config_normalises_and_checks_outer_sharding() -> None:
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=1)
    assert config.data_parallel_sharding_strategy is ZeroDPStrategy.OPTIM
    hybrid = DistributedDataParallelConfig(3, outer_dp_sharding_strategy=1)
    assert hybrid.outer_dp_sharding_strategy is ZeroDPStrategy.OPTIM
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy: 'optim' .* got 'no_shard'"):
        DistributedDataParallelConfig(outer_dp_sharding_strategy="optim")
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy: 3 is not supported"):
        DistributedDataParallelConfig(3, outer_dp_sharding_strategy=3)
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy: unknown strategy 7"):
        DistributedDataParallelConfig(data_parallel_sharding_strategy=7)


def test_mixed_precision_resolution() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert policy.resolve(torch.float32) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.float32,
    )
    assert MixedPrecisionPolicy(main_params_dtype=None).resolve(torch.float32)[1] is torch.float32
    with pytest.raises(ValueError, match="param_dtype must be None or one of"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
