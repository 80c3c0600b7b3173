"""``mf-plan --search``: what it returns runs within the memory given, and its lines are mf-train's.

The search plans the tiny preset on two GPUs with a memory cap below its
configurations' peaks at the largest micro-batch; each configuration it
returns then trains one step on two real gloo ranks, wrapped by mf-train's own
sharding call under ``MemTracker`` (as ``test_peaks.py`` measures), and every
rank's measured peak must be within the cap. Every command line it prints must
parse with mf-train's own option parser. A cap nothing fits is one line, exit 2,
naming a memory that then fits.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from mf.models import GPT, PRESETS, Block
from mf.plan.cli import main
from mf.train.data.sequence_shards import sequence_shards
from mf.train.rank.setup import shard_module, train_mesh
from mf.train.run.options import parse_options
from tests._multiprocess import run_on_ranks

_WORLD = 2
# Bytes: without the allowance for the reduction buffers the search returns configurations
# that run over this (ZeRO-1, two replicas, micro-batch 1: 2,894,464 bytes measured).
_CAP = 2_800_000
_ARGV = ["--model", "tiny", "--gpus", "2", "--micro-batch", "4", "--seq-len", "64", "--search"]
_ARGV += ["--gpu-memory", repr(_CAP / (1 << 30))]


def _search(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _rank_peaks(rank: int, world: int, configurations: list[dict]) -> None:
    over = []
    for c in configurations:
        mesh = train_mesh("cpu", world, tp=1, cp=c["cp"], dp_outer=c["dp_outer"])
        torch.manual_seed(0)
        module = GPT(PRESETS["tiny"])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, (optimizer,) = shard_module(
            module, [optimizer], mesh, [Block], zero=c["zero"], precision="bf16"
        )
        tokens = torch.randint(0, 256, (c["micro_batch"], c["seq_len"] + 1))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            with sequence_shards(mesh["cp"], inputs, targets) as positions:
                model(inputs, targets, positions=positions).backward()
            optimizer.step()
        peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
        if peak > _CAP:
            over.append(f"{c['command']}: measured {peak:,} > {_CAP:,}")
    assert not over, "\n".join(over)


@pytest.mark.multiprocess
def test_what_the_search_returns_runs_within_the_memory_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = _search(capsys, *_ARGV)["configurations"]
    assert found
    assert max(c["micro_batch"] for c in found) < 4  # the cap binds (on an H100: 4)
    assert all(c["need_bytes"] <= _CAP for c in found)
    run_on_ranks(_rank_peaks, _WORLD, found, timeout=120)  # all of them, not only the top


@pytest.mark.parametrize("gpus", ["2", "16"], ids=["one node", "two nodes"])
def test_every_command_line_parses_with_mf_train(
    gpus: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_ARGV[:-2]]
    argv[argv.index("--gpus") + 1] = gpus
    for c in _search(capsys, *argv)["configurations"]:
        words = shlex.split(c["command"])
        if gpus == "2":
            assert words[0] == "mf-train"
            options = parse_options(words[1:])
        else:  # torchrun on each node runs mf-train's worker, which parses the same options
            assert words[:2] == ["torchrun", "--nnodes"]
            options = parse_options(words[words.index("mf.train.rank.worker") + 1 :])
        got = (options.zero, options.dp_outer, options.cp, options.micro_batch)
        assert got == (c["zero"], c["dp_outer"], c["cp"], c["micro_batch"])
        assert (options.grad_accum, options.seq_len) == (c["grad_accum"], c["seq_len"])


def test_a_memory_nothing_fits_names_one_that_does(capsys: pytest.CaptureFixture[str]) -> None:
    argv = _ARGV[:-2]
    assert main([*argv, "--gpu-memory", "0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "no configuration of 'tiny' on 2 GPUs fits 0.001 GiB" in err[0]
    smallest = err[0].split("the smallest needs ")[1].split(" GiB")[0]
    assert _search(capsys, *argv, "--gpu-memory", smallest)["configurations"]


def test_a_global_batch_no_micro_batch_divides_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*_ARGV[:-2], "--global-batch", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--global-batch 3" in err[0]


def test_the_global_batch_is_made_up_with_grad_accum(capsys: pytest.CaptureFixture[str]) -> None:
    for c in _search(capsys, *_ARGV[:-2], "--global-batch", "16")["configurations"]:
        dp = _WORLD // c["cp"]
        assert c["micro_batch"] * c["grad_accum"] * dp == 16
