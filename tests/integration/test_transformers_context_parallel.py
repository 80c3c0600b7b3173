"""A Hugging Face Llama under mf's context parallelism and FSDP trains as one process does.

The model is transformers' own ``LlamaForCausalLM`` (a tiny random config,
``attn_implementation="sdpa"``, grouped-query heads) with nothing changed:
each of 2 ranks holds its head-tail half of every sequence, passes its
``position_ids`` (a buffer ``mf_tp.context_parallel`` shards with the tokens),
and transformers' SDPA call is served by mf's CP attention. FSDP (ZeRO-3)
shards and reduces over the same 2 ranks. The loss is taken from the logits
against targets shifted before sharding: the model's own ``labels=`` shifts
inside the sequence, which on a shard would pair tokens across chunk borders.

fp32, SGD at lr 0.5 for 3 steps: losses and every parameter at rtol 1e-5 of
one process on the same batches (only the order of sums differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import mf_fsdp
import mf_tp
from tests._multiprocess import cpu_mesh, preload_in_ranks, run_on_ranks
from tests.fsdp._helpers import assert_matches_reference, full_params

# The ranks import this module (their functions are its), and so transformers' models:
# seconds of CPU per rank, which the forkserver pays once instead.
preload_in_ranks(__name__)

VOCAB, BATCH, SEQ, STEPS = 128, 2, 16, 3


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1].clone(), data[:, 1:].clone()


def _loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, **kw) -> torch.Tensor:
    logits = model(input_ids=ids, **kw).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_llama(rank: int, world: int) -> None:
    mesh = cpu_mesh((world,), ("cp",))
    module = _llama()
    model, opt = mf_fsdp.fully_shard(
        module,
        torch.optim.SGD(module.parameters(), lr=0.5),
        device_mesh=mesh,
        fsdp_unit_modules=[LlamaDecoderLayer],
    )
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        position_ids = torch.arange(SEQ).expand(BATCH, SEQ).clone()
        with mf_tp.context_parallel(
            mesh, buffers=[ids, targets, position_ids], buffer_seq_dims=[1, 1, 1]
        ):
            loss = _loss(model, ids, targets, position_ids=position_ids)
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    ref_losses, ref_params = _reference()
    assert_matches_reference(
        losses, full_params(model), ref_losses, ref_params, "llama", 1e-5, 1e-6
    )


@pytest.mark.multiprocess
def test_llama_under_cp2_and_fsdp_equals_one_process() -> None:
    run_on_ranks(_rank_llama, 2, timeout=120)
