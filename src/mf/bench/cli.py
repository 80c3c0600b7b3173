"""``mf-bench``: mf's FSDP engine side by side with PyTorch FSDP2 and DDP.

Each (engine, round) is a fresh group of processes started by torch's
elastic launcher, so peak memory is that engine's alone; rounds rotate the
engine order to spread machine noise over all engines. A single-process run
of the same global batch gives the reference loss curve.

Printed per model preset, engine and optimizer recipe (``--optimizers``):
median step time, its ratio to FSDP2 and to DDP with the same optimizers (a
compiled engine, ``NAME+compile``, against compiled FSDP2 and DDP when they ran) and
to the same engine with the first recipe, the median time of the optimizers'
``step()`` (with the engine's step hooks: the last gradient reduction's wait,
the weights' install) and its share of the step, peak memory per rank,
model-state bytes per rank against 16 * params / world (fp32 weights, grads
and two Adam moments), collectives per step and bytes each rank sends
against the ZeRO-3 minimum of 3 * params * (world - 1) / world elements, the
bytes each rank actually wrote to its sockets (``/proc/self/io``, CPU runs)
against the same minimum, and the largest loss difference to the
single-process run of the same recipe. Then tokens/s over all ranks and, on a
GPU whose peak is known (``mf.mfu``, or ``--peak-tflops``), the model FLOPs
utilisation.

``--precision`` takes a list (``bf16,fp8``): one table per precision, and with
both bf16 and fp8 a third that sets fp8 against bf16 for each engine: tokens/s
and the bytes each rank sends in one no-grad forward, which are the weights it
gathers (fp8: the blocks' linears in torchao float8; ``FP8 gather`` says whether
the engine gathers them in FP8, see ``mf.bench.engines.gathers_float8``).

A second table per preset shows the host's cost per step against ``plain``
(the bare model, no wrapper, no communication): the main thread's CPU ms, the
aten ops one step dispatches and, on CUDA, the kernels it launches. Run the
``tiny`` preset to see the host alone (its tensors make the compute nothing).

``--cp 1,2`` runs every engine at each context-parallel size: each
data-parallel rank's ``--micro-batch`` sequences are split over ``cp`` ranks
(``mf_tp.context_parallel``), the engines shard over all of them. A further
table compares each cp size with cp 1 per rank: step time, tokens/s, the
activation bytes the forward saves for the backward, and the bytes sent over
the cp group against a ring's least and the causal least (the ``long``
preset is made for it: 8192 positions).

``--moe 16,64`` prints the mixture-of-experts tables instead (``mf.bench.moe``):
mf-tp's grouped experts against the per-expert loop it replaced (tokens/s and
peak memory, each way in a fresh process), and the all-to-all bytes of
``MoELayer``'s EP dispatch at ep ``--world`` against the least the routed tokens
need.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mf.bench.context_parallel import cp_traffic
from mf.bench.engines import ENGINES, OPTIMIZERS
from mf.bench.moe import moe_tables
from mf.bench.worker import COMPILED, RunSpec, run
from mf.launch import local_launch_config, new_run_id
from mf.mfu import flops_per_token, peak_flops
from mf.models import PRESETS
from mf.models.float8 import float8_unavailable

__all__ = ["main"]

_MIB = 2**20
PRECISIONS = ("fp32", "bf16", "fp8")


def _launch(spec: RunSpec, world_size: int) -> dict[str, Any]:
    """Run ``spec`` on ``world_size`` local processes and return rank 0's result."""
    if spec.engine == "single":
        from torch.multiprocessing import get_context

        with get_context("spawn").Pool(1) as pool:
            return pool.apply(run, (spec,))
    from torch.distributed.launcher.api import elastic_launch

    config = local_launch_config(world_size, new_run_id("mf-bench"))
    return elastic_launch(config, run)(spec)[0]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mf-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="25m", help="comma-separated model presets")
    parser.add_argument(
        "--engines",
        default="plain,ddp,fsdp2,mf-fsdp2,mf-zero3,mf-zero0",
        help=f"comma-separated engines; NAME+{COMPILED} compiles each block (fullgraph=True)",
    )
    parser.add_argument(
        "--optimizers",
        default="adam",
        help=f"comma-separated optimizer recipes, each run with every engine: {OPTIMIZERS}",
    )
    parser.add_argument("--world", type=int, default=2, help="processes per run")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--precision",
        default="fp32",
        help="comma-separated, each of fp32, bf16, fp8. bf16: the FSDP engines' mixed "
        "precision (fp32 main weights), autocast elsewhere; fp8: bf16 with the blocks' "
        "linears in torchao float8 (mf[float8])",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak TFLOP/s for MFU (default: mf.mfu's table for known GPUs)",
    )
    parser.add_argument(
        "--meta-init",
        action="store_true",
        help="build each model on the meta device; sharding engines wrap it, then to_empty and "
        "the model's own init (for a model whose fp32 copy does not fit one device)",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the single-process run of the global batch (no max dloss column)",
    )
    parser.add_argument(
        "--cp",
        default="1",
        help="comma-separated context-parallel sizes, each run with every engine (e.g. 1,2): "
        "each data-parallel rank's --micro-batch sequences split over cp ranks",
    )
    parser.add_argument(
        "--moe",
        default=None,
        help="comma-separated expert counts (e.g. 16,64): print the mixture-of-experts tables "
        "instead of the engines' (grouped experts against the per-expert loop, each count; EP "
        "dispatch bytes at ep --world with the last count; see mf.bench.moe)",
    )
    parser.add_argument("--moe-hidden", type=int, default=256, help="--moe: hidden size H")
    parser.add_argument("--moe-ffn", type=int, default=512, help="--moe: expert FFN size F")
    parser.add_argument("--moe-tokens", type=int, default=4096, help="--moe: tokens per rank")
    parser.add_argument("--moe-top-k", type=int, default=2, help="--moe: experts per token")
    parser.add_argument("--json", default=None, help="also write every run's results here")
    args = parser.parse_args(argv)
    args.cp = _cp_sizes(parser, args)
    args.moe = _moe_counts(parser, args)
    for preset in args.presets.split(","):
        if preset not in PRESETS:
            parser.error(f"--presets: unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    for engine in args.engines.split(","):
        name, plus, mode = engine.partition("+")
        if name not in ENGINES or name == "single" or (plus and mode != COMPILED):
            choices = sorted(set(ENGINES) - {"single"})
            parser.error(
                f"--engines: unknown engine {engine!r}; choose from {choices}, each also "
                f"as NAME+{COMPILED} (every block compiled with fullgraph=True)"
            )
    for recipe in args.optimizers.split(","):
        if recipe not in OPTIMIZERS:
            parser.error(f"--optimizers: unknown recipe {recipe!r}; choose from {OPTIMIZERS}")
    if args.world < 1:
        parser.error(f"--world must be at least 1, got {args.world}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.precisions = args.precision.split(",")
    for precision in args.precisions:
        if precision not in PRECISIONS:
            parser.error(f"--precision: unknown {precision!r}; choose from {PRECISIONS}")
    if "fp8" in args.precisions:
        device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        problem = float8_unavailable(device)
        if problem is not None:
            parser.error(f"--precision fp8: {problem}")
    return args


def _moe_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int] | None:
    """``--moe``'s expert counts, checked against the other ``--moe-*`` sizes and ``--world``."""
    if args.moe is None:
        return None
    for name in ("moe_hidden", "moe_ffn", "moe_tokens", "moe_top_k"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be a positive int, got {getattr(args, name)}")
    try:
        counts = [int(count) for count in args.moe.split(",")]
    except ValueError:
        counts = []
    if not counts or any(count < args.moe_top_k for count in counts):
        parser.error(
            f"--moe: expected comma-separated expert counts of at least --moe-top-k "
            f"({args.moe_top_k}), got {args.moe!r}"
        )
    if counts[-1] % args.world:
        parser.error(
            f"--moe: the last expert count ({counts[-1]}) is spread over --world {args.world} "
            "EP ranks, so it must be a multiple of it"
        )
    return counts


def _cp_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The --cp sizes, each dividing --world and splitting --seq-len into 2 x cp chunks."""
    try:
        sizes = [int(text) for text in args.cp.split(",")]
    except ValueError:
        parser.error(f"--cp: expected comma-separated positive ints, got {args.cp!r}")
    for cp in sizes:
        if cp < 1 or args.world % cp:
            parser.error(f"--cp: {cp} does not divide --world {args.world}")
        if cp > 1 and args.seq_len % (2 * cp):
            parser.error(
                f"--cp: --seq-len {args.seq_len} does not split into 2 x {cp} equal chunks "
                "(load-balanced causal attention)"
            )
        if cp > 1 and any(e.endswith("+" + COMPILED) for e in args.engines.split(",")):
            parser.error(f"--cp: {cp} is not measured with compiled engines (+{COMPILED})")
    return sizes


Runs = dict[tuple[str, str], list[dict[str, Any]]]
"""Every run's results, by (engine label, optimizer recipe); a cp run's label ends in " cpN"."""


def _median_step(results: list[dict[str, Any]], key: str = "step_seconds") -> float:
    return statistics.median(statistics.median(r[key]) for r in results)


def _ratio(value: float, base: list[dict[str, Any]] | None, key: str = "step_seconds") -> str:
    return f"{value / _median_step(base, key):8.2f}" if base else f"{'-':>8}"


def _share(value: float, minimum: float, width: int) -> str:
    """``value / minimum`` in ``width`` characters; "-" where nothing must move (world 1)."""
    return f"{value / minimum:{width}.3f}" if minimum else f"{'-':>{width}}"


def _summarise(
    preset: str,
    runs: Runs,
    references: dict[tuple[str, int], list[float] | None],
    seq_len: int,
    device_peak: tuple[float, str] | None,
) -> list[str]:
    first_recipe = next(iter(references))[0]
    header = (
        f"{'engine':<25} {'optim':<11} {'step ms':>8} {'vs fsdp2':>8} {'vs ' + first_recipe:>8} "
        f"{'opt ms':>7} {'opt %':>6} {'peak MiB':>9} {'state MiB':>9} {'vs 16P/w':>8} "
        f"{'coll/step':>9} {'MiB sent':>9} {'vs 3P(w-1)/w':>12} {'wire MiB':>9} {'wire/min':>8} "
        f"{'vs ddp':>8} {'max dloss':>10} {'tokens/s':>10} {'MFU':>6}"
    )
    rows = [header]
    for (engine, recipe), results in runs.items():
        first = results[0]
        world, params = first["world_size"], first["num_params"]
        step = _median_step(results)
        optimizer = _median_step(results, "optimizer_seconds")
        peak = max(r["peak_bytes"] for r in results)
        state = first["state_bytes"]
        sent = first["bytes_sent_per_step"]
        ideal_sent = 3 * params * (world - 1) / world * 4
        reference = references[(recipe, first["cp"])]
        dloss_text = f"{'-':>10}"
        if reference is not None and not (engine.startswith("plain") and world > 1):
            dloss = max(
                max(abs(a - b) for a, b in zip(r["losses"], reference, strict=True))
                for r in results
            )
            dloss_text = f"{dloss:10.2e}"
        tokens_per_second = first["tokens_per_step"] / step
        flops = flops_per_token(PRESETS[preset], seq_len) * tokens_per_second
        mfu = f"{flops / (device_peak[0] * world):6.3f}" if device_peak else f"{'-':>6}"
        wire = first.get("wire_bytes_per_step")
        wire_text = (
            f"{'-':>9} {'-':>8}"
            if wire is None
            else f"{wire / _MIB:9.1f} {_share(wire, ideal_sent, 8)}"
        )
        vs_ddp = _ratio(step, _peer(runs, "ddp", first, recipe))
        vs_fsdp2 = _ratio(step, _peer(runs, "fsdp2", first, recipe))
        vs_first = _ratio(step, runs.get((engine, first_recipe)))
        rows.append(
            f"{engine:<25} {recipe:<11} {step * 1e3:8.1f} {vs_fsdp2} {vs_first} "
            f"{optimizer * 1e3:7.1f} {100 * optimizer / step:6.1f} "
            f"{peak / _MIB:9.1f} {state / _MIB:9.1f} "
            f"{state / (16 * params / world):8.2f} {first['calls_per_step']:9.1f} "
            f"{sent / _MIB:9.1f} {_share(sent, ideal_sent, 12)} {wire_text} {vs_ddp} {dloss_text} "
            f"{tokens_per_second:10.0f} {mfu}"
        )
    title = f"== preset {preset}: {params / 1e6:.1f}M params, world {world} =="
    footnote = (
        f"MFU against {device_peak[1]} per rank"
        if device_peak
        else "MFU: no known peak for this device"
    )
    return [title, *rows, footnote, "", *_host_cost(runs), *_context_parallel(runs, seq_len)]


def _context_parallel(runs: Runs, seq_len: int) -> list[str]:
    """Each cp run against the same engine at cp 1, per rank; empty without cp runs."""
    if all(results[0]["cp"] == 1 for results in runs.values()):
        return []
    rows = [
        "",
        f"{'engine':<25} {'optim':<11} {'cp':>3} {'step ms':>8} {'tokens/s':>10} "
        f"{'act MiB':>8} {'x cp1':>6} {'peak MiB':>9} {'cp MiB':>8} {'x ring':>7} "
        f"{'x causal':>8} {'x mf model':>10}",
    ]
    for (_, recipe), results in runs.items():
        first = results[0]
        cp, engine = first["cp"], first["engine"]
        base = runs.get((engine, recipe))
        activations = first["activation_bytes"]
        ratio = f"{activations / base[0]['activation_bytes']:6.2f}" if base else f"{'-':>6}"
        step = _median_step(results)
        traffic_text = f"{'-':>8} {'-':>7} {'-':>8} {'-':>10}"
        if cp > 1:
            itemsize = 4 if first["precision"] == "fp32" else 2  # fp8: bf16 attention
            floors = cp_traffic(
                PRESETS[first["preset"]], first["micro_batch"], seq_len, cp, itemsize
            )
            sent = first["cp_bytes_per_step"]
            traffic_text = (
                f"{sent / _MIB:8.2f} {sent / floors.ring:7.2f} {sent / floors.causal:8.2f} "
                f"{sent / floors.mf:10.2f}"
            )
        rows.append(
            f"{engine:<25} {recipe:<11} {cp:3d} {step * 1e3:8.1f} "
            f"{first['tokens_per_step'] / step:10.0f} {activations / _MIB:8.1f} {ratio} "
            f"{max(r['peak_bytes'] for r in results) / _MIB:9.1f} {traffic_text}"
        )
    rows.append(
        "act: bytes the forward saved for the backward per rank; cp MiB: sent over the cp "
        "group per step and rank, against a ring's least 2(cp-1)kv, the causal least "
        "1.5(cp-1)kv and mf's own 3(cp-1)kv per attention (kv: a rank's K and V shard)"
    )
    return rows


def _peer(runs: Runs, peer: str, result: dict[str, Any], recipe: str) -> list[dict] | None:
    """The runs of engine ``peer`` to compare ``result``'s with: compiled if it is, same cp."""
    name = result["engine"]
    suffix = name[len(name.partition("+")[0]) :]
    cp = result["cp"]
    return runs.get((_label(peer + suffix, cp), recipe)) or runs.get((_label(peer, cp), recipe))


def _label(engine: str, cp: int) -> str:
    """A run's row name: the engine, then `` cpN`` for a context-parallel run."""
    return engine if cp == 1 else f"{engine} cp{cp}"


def _host_cost(runs: Runs) -> list[str]:
    """The host's cost per step against ``plain`` (same recipe): CPU ms, ops, kernels."""
    rows = [
        f"{'engine':<25} {'optim':<11} {'step ms':>8} {'x plain':>8} {'cpu ms':>8} {'x plain':>8} "
        f"{'ops/step':>9} {'x plain':>8} {'kernels':>8}"
    ]
    for (engine, recipe), results in runs.items():
        plain = _peer(runs, "plain", results[0], recipe)
        step, cpu = _median_step(results), _median_step(results, "cpu_seconds")
        ops = results[0]["ops_per_step"]
        kernels = results[0]["kernels_per_step"]
        ops_ratio = f"{ops / plain[0]['ops_per_step']:8.2f}" if plain else f"{'-':>8}"
        rows.append(
            f"{engine:<25} {recipe:<11} {step * 1e3:8.2f} {_ratio(step, plain)} {cpu * 1e3:8.2f} "
            f"{_ratio(cpu, plain, 'cpu_seconds')} "
            f"{ops:9d} {ops_ratio} {'-' if kernels is None else kernels:>8}"
        )
    return rows


def _run_preset(
    args: argparse.Namespace, preset: str, precision: str, everything: list[dict[str, Any]]
) -> Runs:
    """Every engine and recipe on ``preset`` at ``precision``, round after round; print its table.

    Each run's result is also appended to ``everything`` (the ``--json`` file).
    """
    engines, recipes = args.engines.split(","), args.optimizers.split(",")

    def spec(engine: str, recipe: str, micro_batch: int, cp: int = 1) -> RunSpec:
        return RunSpec(
            engine,
            preset,
            micro_batch,
            args.seq_len,
            args.steps,
            args.warmup,
            optimizer=recipe,
            device=args.device,
            precision=precision,
            meta_init=args.meta_init,
            cp=cp,
        )

    # The global batch: --micro-batch sequences per data-parallel rank (world / cp).
    references = {
        (recipe, cp): None
        if args.no_reference
        else _launch(spec("single", recipe, args.micro_batch * args.world // cp), 1)["losses"]
        for recipe in recipes
        for cp in args.cp
    }
    cases = [(e, r, cp) for cp in args.cp for r in recipes for e in engines]
    runs: Runs = {(_label(e, cp), r): [] for e, r, cp in cases}
    for round_index in range(args.rounds):
        shift = round_index % len(cases)
        for engine, recipe, cp in cases[shift:] + cases[:shift]:
            result = _launch(spec(engine, recipe, args.micro_batch, cp), args.world)
            result.update(precision=precision, micro_batch=args.micro_batch)
            runs[(_label(engine, cp), recipe)].append(result)
            everything.append(result)
            print(
                f"  round {round_index} {precision} {_label(engine, cp):<25} {recipe:<11} "
                f"median step {statistics.median(result['step_seconds']) * 1e3:.1f} ms",
                flush=True,
            )
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # fp8: the bf16 peak
    device_peak = (
        (args.peak_tflops * 1e12, f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)")
        if args.peak_tflops
        else peak_flops(torch.device(args.device), dtype)
    )
    lines = _summarise(preset, runs, references, args.seq_len, device_peak)
    print(f"-- {precision} --", *lines, sep="\n", flush=True)
    return runs


def _fp8_against_bf16(bf16: Runs, fp8: Runs) -> list[str]:
    """Per engine and recipe: fp8's tokens/s and gathered bytes against bf16's."""
    rows = [
        "-- fp8 against bf16 --",
        f"{'engine':<25} {'optim':<11} {'tok/s bf16':>10} {'tok/s fp8':>10} {'x bf16':>7} "
        f"{'fwd MiB bf16':>12} {'fwd MiB fp8':>11} {'x bf16':>7} {'FP8 gather':>10}",
    ]
    for case, results in fp8.items():
        base = bf16.get(case)
        if not base:
            continue
        speed = [rs[0]["tokens_per_step"] / _median_step(rs) for rs in (base, results)]
        gathered = [rs[0]["forward_gather_bytes"] / _MIB for rs in (base, results)]
        ratio = f"{gathered[1] / gathered[0]:7.3f}" if gathered[0] else f"{'-':>7}"
        rows.append(
            f"{case[0]:<25} {case[1]:<11} {speed[0]:10.0f} {speed[1]:10.0f} "
            f"{speed[1] / speed[0]:7.3f} {gathered[0]:12.2f} {gathered[1]:11.2f} {ratio} "
            f"{'yes' if results[0]['gathers_fp8'] else 'no':>10}"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one table per preset and precision."""
    args = _parse(argv)
    if args.moe is not None:
        print(f"mf-bench --moe: torch {torch.__version__}, {args.device}, world {args.world}")
        sizes = (args.moe_hidden, args.moe_ffn, args.moe_tokens, args.moe_top_k)
        print(*moe_tables(args.world, args.moe, *sizes, args.steps, args.device), sep="\n")
        return 0
    everything: list[dict[str, Any]] = []
    print(
        f"mf-bench: torch {torch.__version__}, device {args.device}, world {args.world}, "
        f"micro-batch {args.micro_batch} x seq {args.seq_len}, cp {args.cp}, "
        f"{args.warmup}+{args.steps} steps, "
        f"{args.rounds} rounds, optimizers {args.optimizers.replace(',', '/')}, "
        f"{args.precision.replace(',', '/')}",
        flush=True,
    )
    for preset in args.presets.split(","):
        runs = {p: _run_preset(args, preset, p, everything) for p in args.precisions}
        if "bf16" in runs and "fp8" in runs:
            print(*_fp8_against_bf16(runs["bf16"], runs["fp8"]), sep="\n", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(everything, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
