"""The MoE GPT's config, the preset lookup and the builders mf-train and mf-sample use."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mf.models import (
    GPT,
    MODEL_PRESETS,
    MOE_PRESETS,
    PRESETS,
    MoEGPT,
    MoEGPTConfig,
    config_from_dict,
    plain_model,
)


def test_every_preset_is_a_model_preset() -> None:
    assert MODEL_PRESETS == {**PRESETS, **MOE_PRESETS}


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_config_round_trips_through_a_dict(name: str) -> None:
    config = MODEL_PRESETS[name]
    assert config_from_dict(dataclasses.asdict(config)) == config


def test_plain_model_builds_the_config_s_model() -> None:
    assert type(plain_model(PRESETS["tiny"])) is GPT
    model = plain_model(MOE_PRESETS["moe-tiny"])
    assert type(model) is MoEGPT
    assert model.blocks[0].moe.experts.fc_weight.shape[0] == 4  # [E, F, H]
    assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_plain_model_refuses_an_ep_group_for_a_dense_config() -> None:
    with pytest.raises(ValueError, match="plain_model: ep_group needs a MoEGPTConfig"):
        plain_model(PRESETS["tiny"], ep_group=object())


def test_moe_gpt_reports_its_routing() -> None:
    torch.manual_seed(0)
    model = MoEGPT(MOE_PRESETS["moe-tiny"])
    with pytest.raises(RuntimeError, match="MoEGPT.routing_stats: no forward has run yet"):
        model.routing_stats()
    tokens = torch.randint(0, 256, (2, 9))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    stats = model.routing_stats()
    assert stats.tokens_per_expert.shape == (2, 4)
    assert stats.tokens_per_expert.sum(dim=1).tolist() == [2 * 8 * 2] * 2  # top-2
    expected = stats.language_loss + 0.01 * stats.load_balance_loss
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(TypeError, match="MoEGPT: config must be a MoEGPTConfig"):
        MoEGPT(PRESETS["tiny"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts": 0}, "num_experts must be a positive int, got 0"),
        ({"top_k": 5}, "top_k=5 exceeds num_experts=4"),
        ({"expert_ffn_size": 2.5}, "expert_ffn_size must be a positive int, got 2.5"),
        ({"load_balance_coeff": -1.0}, "load_balance_coeff must be finite and >= 0, got -1.0"),
        ({"load_balance_coeff": float("nan")}, "load_balance_coeff must be finite"),
        ({"n_heads": 3}, "d_model=128 must be divisible by n_heads=3"),
    ],
)
def test_bad_moe_configs_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEGPTConfig(**fields)
