"""Issue 18's speed goal, settled over several runs: step time with the heads in 4 chunks over 1 (CPU gloo).

Runs ``ulysses-sp bench``'s head-chunk section (:func:`ulysses_sp.bench.runner.head_chunk_section`: the bench
model, C=4 against C=1, plain and checkpointed layers, the steps interleaved) ``--runs`` times back to back at one
sequence length per world size, and pools the per-repetition ratios of every run: the goal (C=4 / C=1 at most 1.05)
is read on the pooled median, decided before the runs, since one run's spread is as wide as the gap to the goal
(BENCHMARKS.md section 6). Also pools the ranks' CPU time ('CPU over the ranks') and the one-process 'compute
alone' steps. With fewer cores than ranks (4 ranks on the 2-core VM) the ranks share cores and the exchanges cannot
overlap anything: the table says how many cores the run had. Prints the table and saves it as Markdown + JSON
under ``benchmarks/results/`` (``--name``).

    python benchmarks/head_chunk_ratio.py                                 # P=4, 8,192 tokens, 3 runs of 7 reps
    python benchmarks/head_chunk_ratio.py --worlds 4 2 --runs 1 --name head_chunk_ratio_16core
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ulysses_sp.bench.config import BenchConfig
from ulysses_sp.bench.headchunks import variant_name
from ulysses_sp.bench.runner import environment, head_chunk_section
from ulysses_sp.bench.tables import md_table, save_table

RESULTS = Path(__file__).parent / "results"
GOAL = 1.05
_MEASURES = (("step time", "step_times_s"), ("CPU over the ranks", "cpu_s"), ("compute alone", "compute_alone_s"))


def pooled(runs: list[dict[str, Any]], key: str, measure: str, checkpointed: bool) -> dict[str, Any]:
    """The per-repetition ratios C=4 / C=1 of ``measure`` at ``key`` ("P@tokens"), over every run: median, quartiles
    and each run's own median."""
    per_run = []
    for run in runs:
        times = run[key][measure]
        four, one = times[variant_name(4, checkpointed)], times[variant_name(1, checkpointed)]
        per_run.append([a / b for a, b in zip(four, one, strict=True)])
    ratios = sorted(r for run in per_run for r in run)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "reps": len(ratios),
        "run_medians": [statistics.median(run) for run in per_run],
    }


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def _markdown(result: dict[str, Any]) -> str:
    rows = []
    for key, by_measure in result["pooled"].items():
        world, tokens = key.split("@")
        for label, summary in by_measure.items():
            goal = "" if not label.startswith("step time") else ("met" if summary["median"] <= GOAL else "not met")
            rows.append(
                [
                    world,
                    f"{int(tokens):,}",
                    label,
                    f"**{summary['median']:.3f}**",
                    f"{summary['q1']:.3f} - {summary['q3']:.3f}",
                    summary["reps"],
                    ", ".join(f"{m:.3f}" for m in summary["run_medians"]),
                    goal,
                ]
            )
    header = ["P", "tokens", "C=4 / C=1", "pooled median", "quartiles", "reps", "per run", f"<= {GOAL}"]
    cores = ", ".join(f"{key}: {cores}" for key, cores in result["cores"].items())
    lines = [
        f"# Head chunks C=4 / C=1 over {result['setup']['runs']} run(s) ({result['date']})",
        "",
        f"{result['machine']}; torch {result['torch']}; commit {result['commit']}; cores the ranks had: {cores}; "
        f"load average {_load(result['load_average_start'])} at the start, "
        f"{_load(result['load_average_end'])} at the end; "
        f"{result['wall_s']:.0f} s.",
        "",
        *md_table(header, rows),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4], help="gloo ranks (each with one thread)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=3, help="runs back to back; their repetitions are pooled")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions a run (none: the bench's, 7 at P=4)")
    parser.add_argument("--name", default="head_chunk_ratio", help="file name (without suffix) under results/")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the .json and .md")
    args = parser.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {args.runs}")
    env, start = environment(), time.monotonic()
    runs: list[dict[str, Any]] = []
    for index in range(args.runs):
        runs.append({})
        for world in args.worlds:  # saved after each world: a run cut off at a time limit keeps what finished
            print(f"run {index + 1} of {args.runs}, {world} ranks", flush=True)
            config = BenchConfig(head_chunk_seq_lens=(args.seq_len,), worlds=(world,), reps=args.reps).resolve()
            runs[-1] |= head_chunk_section(config, print)
            result = _result(env, start, args, runs)
            save_table(args.out, args.name, result, _markdown(result))
    return result


def _result(env: dict[str, Any], start: float, args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = list(dict.fromkeys(key for run in runs for key in run))  # "P@tokens", in the order they ran
    return {
        "machine": env["machine"],
        "torch": env["torch"],
        "commit": env["ulysses_sp_commit"],
        "date": env["date"],
        "load_average_start": env["load_average_start"],
        "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "wall_s": time.monotonic() - start,
        "setup": vars(args) | {"out": str(args.out)},
        "cores": {key: next(run[key]["cores"] for run in runs if key in run) for key in keys},
        "pooled": {
            key: {
                f"{label}{', checkpointed' if checkpointed else ''}": pooled(
                    [run for run in runs if key in run], key, measure, checkpointed
                )
                for label, measure in _MEASURES
                for checkpointed in (False, True)
            }
            for key in keys
        },
        "runs": runs,
    }


if __name__ == "__main__":
    main()
