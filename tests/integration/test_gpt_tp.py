"""GPTTensorParallel is the plain GPT split over a TP group: same loss, logits and gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from mf.models import GPT, PRESETS, GPTTensorParallel
from tests._multiprocess import run_on_ranks


def _rank_matches_plain_gpt(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    tied = PRESETS["tiny"]
    for config in (tied, dataclasses.replace(tied, tie_embeddings=False)):
        torch.manual_seed(0)
        plain = GPT(config)
        tp_model = GPTTensorParallel(config, group)
        tp_model.load_full_weights(plain.state_dict())
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config.vocab_size, (3, 17), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        expected = plain(inputs, targets)
        expected.backward()
        loss = tp_model(inputs, targets)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tp_model(inputs), plain(inputs), rtol=1e-5, atol=1e-5)

        # Gradients: replicated ones whole, sharded ones this rank's piece of the full gradient.
        full_grads = {name: p.grad for name, p in plain.named_parameters()}
        sharded = GPTTensorParallel(config, group)
        sharded.load_full_weights(full_grads)
        for name, param in tp_model.named_parameters():
            piece = dict(sharded.named_parameters())[name]
            torch.testing.assert_close(param.grad, piece, rtol=1e-5, atol=1e-6, msg=name)
        assert sum(p.numel() for p in tp_model.parameters()) < config.num_parameters()

    with pytest.raises(ValueError, match="n_heads=3 is not divisible by the TP size 2"):
        GPTTensorParallel(dataclasses.replace(tied, n_heads=3, d_model=48), group)
    with pytest.raises(KeyError, match="full_state has no 'wte.weight'"):
        tp_model.load_full_weights({})


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tp2_gpt_equals_plain_gpt() -> None:
    run_on_ranks(_rank_matches_plain_gpt, 2, timeout=100)
