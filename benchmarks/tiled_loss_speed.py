"""Speed of the tiled lm_head + cross-entropy against the plain loss, forward + backward, in the same run.

The measurement of ``ulysses-sp bench``'s section 7 (:mod:`ulysses_sp.bench.tiledloss`: plain, tiled and
``recompute=True``, interleaved rounds, medians of wall and process CPU time and of the per-round ratios), at
any size, dtype and device (on CUDA also each variant's peak memory). Prints a table and saves it as Markdown +
JSON under ``benchmarks/results/``.

    python benchmarks/tiled_loss_speed.py                          # CPU: hidden 256, vocab 32K, 4K tokens
    python benchmarks/tiled_loss_speed.py --chunk-tokens 0 1024 256 --rounds 9
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import save_table
from ulysses_sp.bench.tiledloss import DTYPES, measure_chunks, table_lines

RESULTS = Path(__file__).parent / "results"


def _markdown(result: dict) -> str:
    setup = result["setup"]
    lines = [
        f"Tiled loss vs plain, forward + backward: {setup['tokens']} tokens, hidden {setup['hidden']}, "
        f"vocab {setup['vocab']}, {setup['dtype']} on {result['machine']} ({setup['threads']} threads), "
        f"torch {result['torch']}, {result['date']}; median of {setup['rounds']} interleaved rounds (ratio: the "
        "median of each round's ratio, its range in brackets; cpu: process CPU time, all threads).",
        "",
        *table_lines(result["rows"]),
    ]
    if any("peak_mib" in row for row in result["rows"]):
        lines += [
            "",
            "Peak CUDA memory of one forward + backward above what was held before it (MiB; the gradients of the "
            "hidden states and the weight included):",
            "",
            "| chunk tokens | plain | tiled | recompute |",
            "|---:|---:|---:|---:|",
        ]
        for row in result["rows"]:
            p = row["peak_mib"]
            lines.append(f"| {row['chunk_tokens']} | {p['plain']:.0f} | {p['tiled']:.0f} | {p['recompute']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds timed (after one warm-up)")
    parser.add_argument(
        "--chunk-tokens", type=int, nargs="+", default=[0, 512], help="tokens per chunk; 0: the library's default"
    )
    parser.add_argument("--name", default="tiled_loss_speed", help="file name (without suffix) under results/")
    args = parser.parse_args(argv)
    rows = measure_chunks(
        args.tokens,
        args.hidden,
        args.vocab,
        args.chunk_tokens,
        args.rounds,
        args.dtype,
        args.device,
        log=lambda row: print(json.dumps(row), flush=True),
    )
    env = environment()
    result = {
        "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else env["machine"],
        "torch": env["torch"],
        "date": env["date"],
        "setup": {**vars(args), "threads": torch.get_num_threads()},
        "rows": rows,
    }
    save_table(RESULTS, args.name, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
