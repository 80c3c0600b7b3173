"""The Hugging Face Trainer saves and resumes a FULL_STATE_DICT run on mf as on torch's FSDP2.

The same script, twice: ``Trainer`` with ``fsdp=True`` and ``fsdp_config={"fsdp_version":
2, "state_dict_type": "FULL_STATE_DICT", ...}`` trains a tiny Llama (sizes 101, 40, 20,
70: rows that do not split evenly) for 4 steps on 2 gloo ranks, saving at step 2 and 4,
then resumes from checkpoint-2 in a fresh ``Trainer``. Once accelerate wraps with torch's
``fully_shard``, once with ``mf_fsdp.fsdp2.fully_shard`` in its place (set as
``torch.distributed.fsdp.fully_shard``, which accelerate imports when it wraps). The
resume loads the model and the AdamW state through DSD with ``full_state_dict=True,
broadcast_from_rank0=True`` (accelerate's ``load_fsdp_model`` / ``load_fsdp_optimizer``
on several processes); without mf's row cut (``mf_fsdp/checkpoint/rank0_broadcast.py``)
mf's resume stops there with "The size of tensor a (40) must match the size of tensor b
(20)".

accelerate serves FSDP on accelerators only: on the CPU its ``AcceleratorState`` keeps
``MULTI_CPU`` and drops the FSDP plugin (DDP then). One patch here, in the ranks only,
keeps the plugin and sets ``DistributedType.FSDP``; it runs again each time accelerate
builds the state again (which copies ``MULTI_CPU`` back).

Tolerance: the uninterrupted runs of the two engines and the resumed ones agree to 1e-6
(measured: equal to the last digit printed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from mf_fsdp import fsdp2
from tests._multiprocess import preload_in_ranks, run_on_ranks

preload_in_ranks(__name__)

WORLD = 2
VOCAB, SEQ, SAMPLES = 101, 16, 32
STEPS, SAVE_AT = 4, 2
TOL = {"rtol": 1e-6, "atol": 1e-6}
SHARD = {"torch": torch_fsdp.fully_shard, "mf": fsdp2.fully_shard}


class _Tokens(Dataset):
    """Fixed random token rows; the labels are the inputs (the model shifts them)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def _fsdp_on_cpu() -> None:
    """Let accelerate's state keep its FSDP plugin on the CPU (see the module docstring)."""
    accelerate_init = AcceleratorState.__init__

    def init(self: AcceleratorState, *args, fsdp_plugin=None, **kwargs) -> None:
        accelerate_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def _train(engine: str, out: Path, resume: Path | None) -> list[float]:
    """One Trainer run wrapped by ``engine``; the losses it logged (a resume: the new steps)."""
    torch_fsdp.fully_shard = SHARD[engine]  # accelerate imports it when it wraps
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=STEPS,
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        optim="adamw_torch",
        report_to=[],
        seed=0,
        fsdp=True,
        fsdp_config={
            "fsdp_version": 2,
            "state_dict_type": "FULL_STATE_DICT",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
        },
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=_llama(), args=args, train_dataset=_Tokens())
    assert trainer.accelerator.is_fsdp2
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    first = SAVE_AT if resume is not None else 0
    return [entry["loss"] for entry in logged if entry["step"] > first]


def _rank_runs(rank: int, world: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",  # else accelerate sets the CPU threads on a multi-CPU run
    )
    _fsdp_on_cpu()
    found: dict[str, list[float]] = {}
    for engine in ("torch", "mf"):
        out = Path(root) / engine
        found[engine] = _train(engine, out, None)
        found[f"{engine} resumed"] = _train(engine, out / "resumed", out / f"checkpoint-{SAVE_AT}")
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps(found))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_trainer_full_state_dict_resume_on_mf_equals_fsdp2(tmp_path: Path) -> None:
    run_on_ranks(_rank_runs, WORLD, str(tmp_path), timeout=540)
    found = json.loads((tmp_path / "losses.json").read_text())
    assert len(found["torch"]) == STEPS
    assert len(found["torch resumed"]) == STEPS - SAVE_AT
    torch.testing.assert_close(found["mf"], found["torch"], **TOL)
    torch.testing.assert_close(found["mf resumed"], found["torch resumed"], **TOL)
    torch.testing.assert_close(found["mf resumed"], found["mf"][SAVE_AT:], **TOL)
