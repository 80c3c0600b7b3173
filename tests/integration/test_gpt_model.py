from __future__ import annotations

import pytest
import torch

from mf.models import GPT, PRESETS, GPTConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_formula(name: str) -> None:
    config = PRESETS[name]
    with torch.device("meta"):  # no storage: the large presets build in no time
        model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_tied_head_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    assert model.lm_head.weight is model.wte.weight
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    loss = model(tokens, torch.randint(0, 256, (2, 16)))  # unrelated targets: near-uniform loss
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match="d_model=10 must be divisible by n_heads=4"):
        GPTConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="n_layers must be a positive int, got 0"):
        GPTConfig(n_layers=0)
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="tokens has 65 positions"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_positions_default_to_the_first_ones_and_are_checked() -> None:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (2, 8))
    plain = model(tokens)
    torch.testing.assert_close(model(tokens, positions=torch.arange(8)), plain)
    torch.testing.assert_close(model(tokens, positions=torch.arange(8).expand(2, 8)), plain)
    # Positions are what the embedding sees: a shifted window differs.
    assert not torch.allclose(model(tokens, positions=torch.arange(8) + 3), plain)
    with pytest.raises(ValueError, match=r"positions must be integers of shape \(8,\) or \(2, 8\)"):
        model(tokens, positions=torch.arange(9))
    with pytest.raises(ValueError, match="got torch.float32 of shape"):
        model(tokens, positions=torch.arange(8.0))
