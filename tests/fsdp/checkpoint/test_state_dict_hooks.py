"""Models whose state-dict hooks rename, split or fuse keys save and load through every mf path.

The model here has what real models do to their state dicts: a fused QKV
projection stored as one ``wqkv`` matrix but saved as ``wq``/``wk``/``wv``
(torchtitan's ``FusedQKVLinear``: a save post-hook splits, a load pre-hook
fuses), a norm whose load pre-hook renames a legacy key (as Hugging Face
models do), and tensor ``_extra_state``. Wrapped by mf, it must keep the
unwrapped model's keys and load them back: ``state_dict``/``load_state_dict``
(full and sharded), ``save_checkpoint``/``load_checkpoint``, torch's DSD, and
the full-state-dict helpers, resuming with the losses of an uninterrupted run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

import mf_fsdp
from tests._multiprocess import run_on_ranks

DIM, HEADS, VOCAB, SEQ = 32, 4, 64, 12


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
    return tensor


class FusedQKV(nn.Module):
    """One ``wqkv`` projection, saved and loaded as separate ``wq``/``wk``/``wv``."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM)
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._fuse_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).reshape(b, s, DIM)

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
        for param in ("weight", "bias"):
            fused = _replicated(state_dict.pop(f"{prefix}wqkv.{param}"))
            for name, part in zip(("wq", "wk", "wv"), fused.chunk(3), strict=True):
                state_dict[f"{prefix}{name}.{param}"] = part.contiguous()

    @staticmethod
    def _fuse_on_load(module, state_dict, prefix, *args) -> None:
        for param in ("weight", "bias"):
            keys = [f"{prefix}{name}.{param}" for name in ("wq", "wk", "wv")]
            if all(key in state_dict for key in keys):
                parts = [_replicated(state_dict.pop(key)) for key in keys]
                state_dict[f"{prefix}wqkv.{param}"] = torch.cat(parts)


class LegacyNorm(nn.Module):
    """RMS norm that loads checkpoints of its old name ``gamma`` and keeps tensor extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))
        self.calls = torch.zeros((), dtype=torch.int64)
        self.register_load_state_dict_pre_hook(self._rename_legacy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.rms_norm(x, (DIM,), self.weight)

    def get_extra_state(self) -> torch.Tensor:
        return self.calls.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.calls = state.clone()

    @staticmethod
    def _rename_legacy(module, state_dict, prefix, *args) -> None:
        if f"{prefix}gamma" in state_dict:
            state_dict[f"{prefix}weight"] = state_dict.pop(f"{prefix}gamma")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LegacyNorm()
        self.attention = FusedQKV()
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.attention(self.norm(x)))
        return x + self.mlp(x)


class HookedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _make(seed: int) -> HookedModel:
    torch.manual_seed(seed)
    return HookedModel()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _wrapped(seed: int, strategy: int):
    module = _make(seed)
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    return mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _train(model, opt, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(state_dict: dict) -> dict:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state_dict.items()
    }


def _assert_same(got: dict, want: dict, label: str) -> None:
    assert list(got) == list(want), f"{label}: keys {list(got)} != {list(want)}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{label} {key}")


def _rank_hooks(rank: int, world: int, tmp: str, strategy: int) -> None:
    root = Path(tmp) / f"zero{strategy}"
    plain = _make(0)
    model, opt = _wrapped(0, strategy)
    # The unwrapped model's keys (wq/wk/wv, _extra_state), its values gathered.
    _assert_same(_full(model.state_dict()), plain.state_dict(), "state_dict")

    # A plain full state dict of another model, with the legacy name, loads as into plain.
    other = _make(7).state_dict()
    legacy = {k.replace("norm.weight", "norm.gamma"): v for k, v in other.items()}
    model.load_state_dict(legacy)
    _assert_same(_full(model.state_dict()), other, "loaded full")
    # A sharded state dict of another mf model (its own DTensors) loads too.
    donor, _ = _wrapped(0, strategy)
    model.load_state_dict(donor.state_dict())
    _assert_same(_full(model.state_dict()), plain.state_dict(), "loaded sharded")

    _train(model, opt, rank, range(3))
    path = mf_fsdp.save_checkpoint(root, model, opt, step=3)
    # torchtitan's resume: the model's own state dict (renamed keys) and DSD's optimizer
    # state (by parameter name), full, through plain dicts.
    options = StateDictOptions(full_state_dict=True)
    saved_model = _full(model.state_dict())
    # A copy: DSD hands out Adam's live step counters, which go on.
    saved_optim = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    expected = _train(model, opt, rank, range(3, 5))

    resumed, resumed_opt = _wrapped(1, strategy)
    assert mf_fsdp.load_checkpoint(path, resumed, resumed_opt)["step"] == 3
    assert _train(resumed, resumed_opt, rank, range(3, 5)) == expected, "load_checkpoint"

    through_dsd, dsd_opt = _wrapped(2, strategy)
    through_dsd.load_state_dict(saved_model)
    set_optimizer_state_dict(through_dsd, dsd_opt, saved_optim, options=options)
    assert _train(through_dsd, dsd_opt, rank, range(3, 5)) == expected, "DSD"
    # DSD's model state dict walks each key's path through module attributes, so it
    # refuses a renamed key (``wq`` is no attribute) on the plain module too: the same here.
    for subject in (plain, model):
        with pytest.raises(AttributeError, match="'FusedQKV' object has no attribute 'wq'"):
            get_model_state_dict(subject)

    # The checkpoint as a full state dict, and its export, load into the unwrapped model.
    full = mf_fsdp.checkpoint_to_full_state_dict(path)
    restored = _make(3)
    restored.load_state_dict(full)
    _assert_same(restored.state_dict(), saved_model, "full from checkpoint")
    if rank == 0:
        from safetensors.torch import load_file

        exported = mf_fsdp.save_full_state_dict(full, root / "export.safetensors")
        _make(4).load_state_dict(load_file(exported))


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", [0, 3])
def test_key_renaming_hooks_save_and_load_through_every_path(strategy: int, tmp_path) -> None:
    run_on_ranks(_rank_hooks, 2, str(tmp_path), strategy, timeout=180)
