"""``ulysses-sp bench``: run every benchmark, write the JSON of results, the plots and BENCHMARKS.md.

Sections (each measured in this run; ratios are taken against a baseline measured in the same run):

1. per-rank saved-activation bytes and peak memory vs sequence length, sp = 1, 2, 4 (one process standing
   in for one rank, checked against a real gloo rank in section 3's world);
2. collectives and bytes per attention layer: ulysses-sp, its ring attention and DeepSpeed measured by one
   counter, next to the formulas;
3. train-step time of ulysses-sp against DeepSpeed's ``UlyssesSPAttentionHF`` and ulysses-sp's ring in the
   same world, and the loss/gradient agreement of each with one process (and of ulysses-sp with DeepSpeed);
4. step time with SP against no SP (dp over the same ranks) at the same tokens per rank;
5. GPU mode (only with CUDA): see :mod:`ulysses_sp.bench.gpu`;
6. step time with the attention heads in 4 chunks over 1 (:mod:`ulysses_sp.bench.headchunks`);
7. the tiled lm_head + loss against the plain loss (:mod:`ulysses_sp.bench.tiledloss`).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .models import bench_model
from .tables import ratio_summary

__all__ = ["DEEPSPEED_MISSING", "environment", "head_chunk_section", "main", "rerender", "run_bench"]

DEEPSPEED_MISSING = (
    "deepspeed is not installed (pip install 'ulysses-sp[deepspeed]', or pip install deepspeed, to run it)"
)


def _run(command: list[str]) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _load_average() -> float | None:
    """The 1-minute load average (how many processes wanted the CPUs): a shared machine shows here."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """Machine, versions and date of this run."""
    import torch
    import transformers

    from .deepspeed_ref import deepspeed_version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_start": _load_average(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu})",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed_version(),
        "ulysses_sp_commit": _run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]),
    }


def _memory_section(config: BenchConfig, log) -> list[dict[str, Any]]:
    import ulysses_sp
    from ulysses_sp.shapes import SHAPES
    from ulysses_sp.standin import StandIn, measure_step, random_batch

    vocab = SHAPES[config.model]["vocab_size"]
    rows = []
    for sp in config.memory_sp:
        with StandIn(sp=sp, sp_rank=sp - 1) as rank:
            model = ulysses_sp.parallelize(bench_model(config.model, max(config.memory_seq_lens)), rank.layout)
            for seq_len in config.memory_seq_lens:
                measured = measure_step(model, rank.shard(random_batch(vocab, seq_len)), rank.layout)
                rows.append({"sp": sp, "seq_len": seq_len, **measured})
                log(f"memory: sp={sp} seq={seq_len}: saved {measured['saved_bytes'] / 2**20:.1f} MiB")
    return rows


def _world_section(config: BenchConfig, log) -> dict[str, Any]:
    from .steptime import RING
    from .world import run_world

    worlds = {}
    for world in config.worlds:
        params = {
            "model": config.model,
            "seq_len": config.seq_len,
            "reps": config.reps_for(world),
            "warmup": 1,
            "deepspeed": config.deepspeed,
        }
        start = time.monotonic()
        result = run_world(world, "ulysses_sp.bench.steptime:worker", params)[0]
        times = result["step_times_s"]
        ratios = {"ulysses-sp / no-sp": ratio_summary(times["ulysses-sp"], times["no-sp"])}
        if "deepspeed" in times:
            ratios["deepspeed / ulysses-sp"] = ratio_summary(times["deepspeed"], times["ulysses-sp"])
        if RING in times:
            ratios[f"{RING} / ulysses-sp"] = ratio_summary(times[RING], times["ulysses-sp"])
        result["ratios"] = ratios
        worlds[str(world)] = result
        log(
            f"world {world}: done in {time.monotonic() - start:.0f} s; "
            + ", ".join(f"{k} {v['median']:.3f}" for k, v in ratios.items())
        )
    return worlds


def head_chunk_section(config: BenchConfig, log) -> dict[str, Any]:
    """Step time with the heads in 4 chunks over 1, per sequence length and world, keyed ``"P@tokens"``
    (:mod:`ulysses_sp.bench.headchunks`)."""
    from .headchunks import COMPUTE_ALONE, CPU_OVER_RANKS, compute_alone, variant_name
    from .world import run_world

    runs = {}
    for seq_len, world in itertools.product(config.head_chunk_seq_lens, config.worlds):
        params = {"seq_len": seq_len, "reps": config.reps_for(world), "warmup": 1}
        start = time.monotonic()
        ranks = run_world(world, "ulysses_sp.bench.headchunks:worker", params)
        result = ranks[0]
        # every rank's CPU seconds, summed per step: with fewer cores than ranks the step takes about that over
        # the cores, whatever overlaps
        result["cpu_s"] = {
            name: [sum(step) for step in zip(*(r["cpu_s"][name] for r in ranks), strict=True)]
            for name in result["cpu_s"]
        }
        result["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # the same steps in one process standing in for rank 0: the chunking's compute, no exchange to hide
        result["compute_alone_s"] = compute_alone(world, seq_len, params["reps"])
        result["ratios"] = {
            label + suffix: ratio_summary(times[variant_name(4, checkpointed)], times[variant_name(1, checkpointed)])
            for suffix, times in (
                ("", result["step_times_s"]),
                (CPU_OVER_RANKS, result["cpu_s"]),
                (COMPUTE_ALONE, result["compute_alone_s"]),
            )
            for label, checkpointed in (("C=4 / C=1", False), ("C=4 / C=1, checkpointed layers", True))
        }
        runs[f"{world}@{seq_len}"] = result
        log(
            f"head chunks, world {world}, {seq_len} tokens: done in {time.monotonic() - start:.0f} s; "
            + ", ".join(f"{k} {v['median']:.3f}" for k, v in result["ratios"].items())
        )
    return runs


def _tiled_loss_section(config: BenchConfig, log) -> dict[str, Any]:
    """The tiled lm_head + loss against the plain loss, forward + backward, at the model's hidden size, on this
    process's threads (:mod:`ulysses_sp.bench.tiledloss`); chunks of the library's default size and of 512
    tokens."""
    import torch

    from ulysses_sp.shapes import SHAPES

    from .tiledloss import measure_chunks

    if not config.loss_tokens:
        return {"skipped": "--loss-tokens 0"}
    setup = {
        "tokens": config.loss_tokens,
        "hidden": SHAPES[config.model]["hidden_size"],
        "vocab": config.loss_vocab,
        "rounds": config.loss_rounds(),
        "dtype": "fp32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
    }
    start = time.monotonic()
    rows = measure_chunks(setup["tokens"], setup["hidden"], setup["vocab"], [0, 512], setup["rounds"], "fp32", "cpu")
    log(
        f"tiled loss: done in {time.monotonic() - start:.0f} s; tiled / plain "
        + ", ".join(f"{row['chunks']} chunks {row['cpu_ratio']['tiled']:.2f}x CPU" for row in rows)
    )
    return {"setup": setup, "rows": rows}


def _comm_table(config: BenchConfig, worlds: dict[str, Any]) -> list[dict[str, Any]]:
    from ulysses_sp.shapes import SHAPES
    from ulysses_sp.traffic import ring_p2p_per_layer, ulysses_bytes_per_layer

    shape = SHAPES[config.model]
    rows = []
    for world, result in worlds.items():
        sp, layers, seq_len = int(world), result["num_layers"], result["seq_len"]
        for name, counted in result["collectives"].items():
            calls, sent = counted["calls"], counted["bytes"]
            rows.append(
                {
                    "sp": sp,
                    "implementation": name,
                    "source": "measured",
                    "all_to_all_per_layer": calls.get("all_to_all", 0) / layers,
                    "all_to_all_bytes_per_layer": sent.get("all_to_all", 0) / layers,
                    "all_gather_per_step": calls.get("all_gather", 0),
                    "all_gather_bytes_per_step": sent.get("all_gather", 0),
                    "p2p_sends_per_layer": calls.get("send", 0) / layers,
                    "p2p_bytes_per_layer": sent.get("send", 0) / layers,
                }
            )
        ring = ring_p2p_per_layer(
            batch=1,
            seq_len=seq_len,
            ring=sp,
            kv_heads=shape["num_key_value_heads"],
            head_dim=shape["head_dim"],
            element_size=4,
        )
        rows.append(
            {
                "sp": sp,
                "implementation": "ring attention",
                "source": "formula",
                "all_to_all_per_layer": 0,
                "all_to_all_bytes_per_layer": 0,
                "p2p_bytes_per_layer": ring["forward_bytes"] + ring["backward_bytes"],
                "p2p_sends_per_layer": ring["forward_sends"] + ring["backward_sends"],
                "all_gather_per_step": 0,
                "all_gather_bytes_per_step": 0,
            }
        )
        rows.append(
            {
                "sp": sp,
                "implementation": "ulysses formula",
                "source": "formula",
                "all_to_all_bytes_per_layer": ulysses_bytes_per_layer(
                    batch=1,
                    seq_len=seq_len,
                    sp=sp,
                    heads=shape["num_attention_heads"],
                    kv_heads=shape["num_key_value_heads"],
                    head_dim=shape["head_dim"],
                    element_size=4,
                ),
            }
        )
    return rows


def run_bench(config: BenchConfig, log=print, command: str = "ulysses-sp bench") -> dict[str, Any]:
    """Run every section, write ``results.json``, the PNGs and the markdown; returns the results."""
    from .deepspeed_ref import deepspeed_available
    from .gpu import run_gpu
    from .plots import write_plots
    from .report import check_markdown_target, write_markdown

    config.validate()
    config = config.resolve()
    markdown = config.markdown_path
    if markdown:
        check_markdown_target(Path(markdown))  # before the measuring, not after it
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {"config": {**asdict(config), "command": command}, "environment": environment()}
    if not config.deepspeed:
        log("bench: DeepSpeed comparison skipped: --no-deepspeed")
    elif not deepspeed_available():
        results["deepspeed_skipped"] = DEEPSPEED_MISSING
        log(f"bench: DeepSpeed comparison skipped: {DEEPSPEED_MISSING}")
    results["memory"] = _memory_section(config, log)
    results["worlds"] = _world_section(config, log)
    results["comm"] = _comm_table(config, results["worlds"])
    results["head_chunks"] = head_chunk_section(config, log)
    results["tiled_loss"] = _tiled_loss_section(config, log)
    results["gpu"] = run_gpu(log=log, **config.gpu_settings()) if config.gpu == "auto" else {"skipped": "--gpu off"}
    if config.gpu == "auto" and "skipped" in results["gpu"]:
        log(f"bench: GPU mode skipped: {results['gpu']['skipped']}")
    results["wall_s"] = time.monotonic() - started
    results["environment"]["load_average_end"] = _load_average()
    results["plots"] = write_plots(results, out_dir)
    with open(out_dir / "results.json", "w") as handle:
        json.dump(results, handle, indent=1)
    if markdown:
        write_markdown(results, Path(markdown), out_dir)
    log(f"bench: wrote {out_dir / 'results.json'}" + (f" and {markdown}" if markdown else ""))
    return results


def rerender(results_path: Path, markdown: Path | None, out_dir: Path | None = None) -> None:
    """Redraw the PNGs and rewrite the markdown of an earlier run from its ``results.json`` (no measuring)."""
    from .plots import write_plots
    from .report import check_markdown_target, write_markdown

    if markdown is not None:
        check_markdown_target(markdown)
    results = json.loads(results_path.read_text())
    results["rendered_by"] = f"ulysses-sp bench --report-from {results_path}"
    out_dir = out_dir or results_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results, out_dir)
    if markdown is not None:
        write_markdown(results, markdown, out_dir)


def main(argv: Sequence[str]) -> int:
    """``ulysses-sp bench [flags]``; returns the exit status (2, naming the flag, on bad input)."""
    from ulysses_sp.cli_config import parse_config

    try:
        config = parse_config(
            BenchConfig,
            argv,
            prog="ulysses-sp bench",
            description="Benchmark ulysses-sp against DeepSpeed's Ulysses, ring attention and no SP; writes "
            "results.json, PNG plots and BENCHMARKS.md.",
        )
    except SystemExit as exit_:  # argparse's exit: --help (0) or a bad flag (2, message printed)
        return int(exit_.code or 0)
    from ulysses_sp.train.outdir import prepare_output_dir  # (after the flags: --help and a bad flag import no torch)

    from .report import check_markdown_target

    try:
        if config.markdown_path:
            check_markdown_target(Path(config.markdown_path))
        if config.report_from is None:  # where a run writes, before it measures (for minutes, or hours on a GPU)
            prepare_output_dir(config.resolve().output_dir)
            if config.markdown_path:
                prepare_output_dir(str(Path(config.markdown_path).parent), flag="--markdown's folder")
    except ValueError as error:
        print(f"ulysses-sp bench: error: {error}", file=sys.stderr)
        return 2
    if config.report_from is not None:
        source = Path(config.report_from)
        if not source.is_file():
            print(f"ulysses-sp bench: error: --report-from {source}: no such file", file=sys.stderr)
            return 2
        markdown = Path(config.markdown_path) if config.markdown_path else None
        try:
            rerender(source, markdown, Path(config.output_dir) if config.output_dir else None)
        except (ValueError, KeyError, TypeError, IndexError) as error:  # json's errors are ValueErrors
            what = f"missing {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
            print(
                f"ulysses-sp bench: error: --report-from {source}: not a results.json this version of ulysses-sp "
                f"bench can render ({what})",
                file=sys.stderr,
            )
            return 2
        return 0
    run_bench(config, log=lambda text: print(text, flush=True), command=shlex.join(["ulysses-sp", "bench", *argv]))
    return 0
