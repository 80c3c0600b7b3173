"""Packed examples are kept apart: each one's logits in a packed row equal its logits alone.

A tiny transformers Llama (random weights, built here) in mf's ``CausalLM``
reads rows of three examples of 5, 9 and 7 tokens and 3 of padding, their
positions restarting at each example (``mf.train.data.packing``); the logits of
each example must equal those of the example run alone to 1e-5, under the SDPA
and the eager attention.

Planted: a mask that keeps no example apart (2-D, all ones) misses by ~1e-1;
so do positions that never restart (rows read as one example). Passing the
model ``arange`` positions beside the right mask changes no logit beyond float
error (RoPE scores depend on position differences only), so the test also checks
that the positions the rotary embedding reads are the restarted ones. Left out
altogether, the mask is rebuilt by transformers itself from the restarted
positions (``find_packed_sequence_indices``): the test passes, rightly.
"""

from __future__ import annotations

import pytest
import torch

from mf.train.data.packing import row_positions
from mf.train.sources.example_mask import example_mask
from mf.train.sources.model_folder import CausalLM

_LENGTHS = [5, 9, 7]
_CAPACITY = 24


def _model(implementation: str) -> CausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=implementation,
    )
    return CausalLM(LlamaForCausalLM(config).eval())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@torch.no_grad()
def test_each_packed_example_has_its_logits_alone(implementation: str) -> None:
    model = _model(implementation)
    generator = torch.Generator().manual_seed(1)
    examples = [torch.randint(0, 64, (n,), generator=generator) for n in _LENGTHS]
    padding = torch.zeros(_CAPACITY - sum(_LENGTHS), dtype=torch.long)
    rows = torch.stack([torch.cat([*examples, padding]), torch.cat([*examples[::-1], padding])])
    positions = torch.stack(
        [row_positions(_LENGTHS, _CAPACITY), row_positions(_LENGTHS[::-1], _CAPACITY)]
    )
    assert positions[0, :6].tolist() == [0, 1, 2, 3, 4, 0]  # restarted per example
    seen = []
    rotary = model.lm.model.rotary_emb
    hook = rotary.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True
    )
    packed = model(rows, positions=positions)
    hook.remove()
    assert torch.equal(seen[0].expand_as(positions), positions)  # RoPE reads the restarts
    for row, order in enumerate([examples, examples[::-1]]):
        start = 0
        for example in order:
            alone = model(example[None])[0]
            got = packed[row, start : start + len(example)]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            start += len(example)


def test_the_mask_is_block_diagonal_causal() -> None:
    mask = example_mask(row_positions([2, 3], 6)[None], "sdpa")[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # the padding, a segment of its own
    ]


def test_an_attention_the_mask_cannot_serve_is_refused() -> None:
    with pytest.raises(ValueError, match="flash_attention_2.*--no-pack"):
        example_mask(row_positions([2], 4)[None], "flash_attention_2")
