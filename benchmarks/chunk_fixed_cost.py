"""What head chunks cost a rank in compute, by sequence length: C=4 against C=1, with nothing to overlap.

Runs ``ulysses_sp.bench.headchunks.compute_alone`` (``ulysses-sp bench`` section 6's 'compute alone' rows: one process
standing in for rank 0 of sp = P, each exchange a local copy, one thread) at each ``--seq-lens``: the train-step time
of ``llama-bench-heads`` with C=1 and C=4, plain and with checkpointed layers, interleaved. The table gives the
median step times and the medians of the per-repetition differences (C=4 - C=1, ms) and ratios (with their range).
The difference has a part fixed per chunk (the chunks' Python code and small ops: what is left at short lengths)
and a part that grows with the tokens (q/k/v and RoPE projected again in backward, the output projection added
chunk by chunk, the exchange buffers packed); the attention core, which all of them are compared with, grows with
the square. Prints the table and saves it as Markdown + JSON under ``benchmarks/results/``.

    python benchmarks/chunk_fixed_cost.py                      # P=4 at 256, 1024 and 4096 tokens
    python benchmarks/chunk_fixed_cost.py --sp 2 --seq-lens 512 4096 8192 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ulysses_sp.bench.headchunks import HEAD_CHUNK_MODEL, compute_alone, variant_name
from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import ratio_summary, save_table

RESULTS = Path(__file__).parent / "results"


def rows_for(seq_len: int, times: dict[str, list[float]]) -> list[dict]:
    """One row per layer setting: median C=1 and C=4 step times, their difference and the median per-rep ratio."""
    rows = []
    for checkpointed in (False, True):
        one, four = times[variant_name(1, checkpointed)], times[variant_name(4, checkpointed)]
        ratio = ratio_summary(four, one)  # per repetition: its two steps ran back to back
        rows.append(
            {
                "tokens": seq_len,
                "layers": "checkpointed" if checkpointed else "plain",
                "c1_ms": 1e3 * ratio["baseline_median_time_s"],
                "c4_ms": 1e3 * ratio["median_time_s"],
                "difference_ms": 1e3 * statistics.median(b - a for a, b in zip(one, four, strict=True)),
                "ratio": ratio["median"],
                "ratio_min": ratio["min"],
                "ratio_max": ratio["max"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=4, help="The world size whose rank 0 is stood in for.")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=9, help="Timed repetitions (after one warm-up).")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for seq_len in args.seq_lens:
        if seq_len < 1 or seq_len % args.sp:
            raise ValueError(f"--seq-lens {seq_len} must be a positive multiple of --sp {args.sp}")
    rows = []
    for seq_len in args.seq_lens:
        rows += rows_for(seq_len, compute_alone(args.sp, seq_len, args.reps))
    env = environment()
    lines = [
        f"# Head chunks in compute alone: C=4 against C=1, `{HEAD_CHUNK_MODEL}`, stand-in rank 0 of sp={args.sp}",
        "",
        f"{args.reps} repetitions, one thread, each with one step of every variant in a rotating order; medians. "
        f"Machine: {env['machine']}, torch {env['torch']}.",
        "",
        "| tokens | layers | C=1 ms | C=4 ms | C=4 - C=1 ms | C=4 / C=1 | min - max |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['tokens']:,} | {r['layers']} | {r['c1_ms']:.1f} | {r['c4_ms']:.1f} | "
            f"{r['difference_ms']:.1f} | {r['ratio']:.3f} | {r['ratio_min']:.3f} - {r['ratio_max']:.3f} |"
            for r in rows
        ),
        "",
    ]
    result = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    save_table(args.out, f"chunk_fixed_cost_sp{args.sp}", result, "\n".join(lines))
    return result


if __name__ == "__main__":
    main()
