"""Peak resident memory of each rank while ``mf-train --model PATH`` loads a model folder.

The issue's bound: each rank's peak RSS while loading is at most 1.3x its share
of the weights plus a fixed overhead. This script writes a Llama folder of
random fp32 weights once (about 300M parameters by default, in several
safetensors shards with their index, as downloaded models come), then, on
``--world`` fresh gloo processes, runs mf-train's own loading path
(``parse_options``, ``setup``, ``build``: the model built on the meta device,
wrapped with ZeRO-3, each rank reading its rows) and reports per rank:

- ``peak``: the process's peak RSS (``ru_maxrss``) once the weights are in;
- ``overhead``: the same for a tiny folder (2 layers of width 64), the memory
  of Python, torch, transformers and the process group, loaded the same way;
- ``share``: the bytes of the weights this rank holds (its main shards);
- ``with AdamW state``: the peak again after ``build()``'s last step binds the
  optimizer and makes its state (two more shares in fp32: mf-fsdp's
  [Note: eager optimizer state]), which mf-train does once the weights are in.

``(peak - overhead) / share`` is the ratio the bound caps at 1.3.

Run: ``uv run --no-sync python benchmarks/folder_load_memory.py`` (about a
minute on 2 CPU cores; the folder, 1.3 GB, lives in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["main", "write_random_folder"]

_MIB = 2**20
_SHARD_BYTES = 400 * _MIB


def write_random_folder(
    folder: Path, hidden: int, layers: int, intermediate: int, vocab: int
) -> int:
    """A Llama folder of random fp32 weights in ~400 MB shards; returns its parameters.

    Each tensor is drawn and written shard by shard, so writing it never holds
    the whole model. No tokenizer: loading the weights does not read one.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key, shape in shapes.items():
        shard[key] = torch.randn(shape, generator=generator) * 0.02
        if sum(t.nbytes for t in shard.values()) >= _SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(shape.numel() for shape in shapes.values())


def _load(rank: int, world: int, folder: str, port: int, results: str) -> None:
    """One rank: mf-train's loading path, then its peak RSS and its share of the weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from mf.train.rank.setup import bind_optimizers, load_folder_model, setup
        from mf.train.run.options import parse_options
        from mf.train.sources.model_folder import folder_of

        argv = ["--model", folder, "--device", "cpu", "--nproc", str(world)]
        argv += ["--zero", "3", "--precision", "fp32", "--seq-len", "64"]
        options = parse_options(argv)
        device, mesh = setup(options)
        model, optimizers = load_folder_model(options, mesh, device, folder_of(options.model))
        peak = _peak_rss()
        share = sum(_local(p).nbytes for p in model.parameters())
        bind_optimizers(model, optimizers)  # build()'s last step: AdamW's state, 2 shares
        with_state = _peak_rss()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    record = {"peak": peak, "share": share, "with_state": with_state}
    Path(results, f"rank{rank}.json").write_text(json.dumps(record))


def _peak_rss() -> int:
    """This process's peak resident bytes (``VmHWM``).

    Not ``ru_maxrss``: Linux carries that across ``exec`` from the forking parent,
    so a spawned rank would report the parent's peak (the folder writer's).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(value: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a (possibly sharded) parameter."""
    return getattr(value, "_local_tensor", value)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def measure(folder: Path, world: int) -> list[dict[str, int]]:
    """Each rank's peak RSS and share of the weights, loading ``folder`` on fresh processes."""
    with tempfile.TemporaryDirectory() as results:
        torch.multiprocessing.spawn(
            _load, args=(world, str(folder), _free_port(), results), nprocs=world
        )
        return [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv: Sequence[str] | None = None) -> int:
    """Write both folders, load each at ``--world``, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks on this machine")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world: expected a positive number of ranks, got {args.world}")
    with tempfile.TemporaryDirectory() as root:
        tiny = Path(root, "tiny")
        write_random_folder(tiny, 64, 2, 128, 320)
        big = Path(root, "big")
        parameters = write_random_folder(
            big, args.hidden, args.layers, args.intermediate, args.vocab
        )
        overhead = measure(tiny, args.world)
        loaded = measure(big, args.world)
    print(
        f"folder load memory: torch {torch.__version__}, Llama of {parameters / 1e6:.0f}M "
        f"fp32 parameters ({parameters * 4 / _MIB:,.0f} MiB), world {args.world}, ZeRO-3, CPU"
    )
    print(
        "rank   share MiB   peak MiB   overhead MiB   (peak - overhead) / share"
        "   with AdamW state MiB   (that - overhead) / share"
    )
    for rank, (big_rank, tiny_rank) in enumerate(zip(loaded, overhead, strict=True)):
        share, peak, fixed = big_rank["share"], big_rank["peak"], tiny_rank["peak"]
        state = big_rank["with_state"]
        print(
            f"{rank:4d}   {share / _MIB:9,.0f}   {peak / _MIB:8,.0f}   {fixed / _MIB:12,.0f}"
            f"   {(peak - fixed) / share:25.2f}   {state / _MIB:20,.0f}"
            f"   {(state - fixed) / share:25.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
