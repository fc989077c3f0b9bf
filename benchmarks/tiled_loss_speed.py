"""Speed of the tiled lm_head + cross-entropy against the plain loss, forward + backward, in the same run.

Times ``lm_head`` + ``F.cross_entropy(logits.float())`` (``plain``), the tiled loss (``tiled``: each chunk's
gradient made in the forward, backward only scales) and the tiled loss with ``recompute=True`` (``recompute``:
the logits recomputed in backward, the previous algorithm) on the same inputs. Rounds interleave the variants;
each round's ratio is taken against that round's plain time and the table shows the medians, of wall time and
of process CPU time (no absolute times from a shared machine are compared across runs). Prints a table
and saves it as Markdown + JSON under ``benchmarks/results/``.

    python benchmarks/tiled_loss_speed.py                          # CPU: hidden 256, vocab 32K, 4K tokens
    python benchmarks/tiled_loss_speed.py --chunk-tokens 0 1024 256 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ulysses_sp.bench.report import save_table
from ulysses_sp.tiled_loss import loss_chunk_tokens, tiled_cross_entropy_sum

RESULTS = Path(__file__).parent / "results"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _variants(chunk: int) -> dict[str, Callable]:
    def plain(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")

    def tiled(h, w, t):
        return tiled_cross_entropy_sum(h, w, t, chunk_tokens=chunk)

    def recompute(h, w, t):
        return tiled_cross_entropy_sum(h, w, t, chunk_tokens=chunk, recompute=True)

    return {"plain": plain, "tiled": tiled, "recompute": recompute}


def _seconds(fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[float, float, float]:
    """Wall and process-CPU seconds of one forward + backward (the loss divided by the token count, as a mean
    loss would be), and on CUDA the peak bytes it allocated above what was held before it (the gradients of h
    and w included; 0 on CPU). On a shared CPU the CPU seconds leave out the time spent waiting for a core."""
    h.grad = w.grad = None
    base = 0
    if h.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    wall, cpu = time.perf_counter(), time.process_time()
    (fn(h, w, t) / t.numel()).backward()
    peak = 0.0
    if h.is_cuda:
        torch.cuda.synchronize()
        peak = float(torch.cuda.max_memory_allocated() - base)
    return time.perf_counter() - wall, time.process_time() - cpu, peak


def measure(tokens: int, hidden: int, vocab: int, chunk: int, rounds: int, dtype: str, device: str) -> dict:
    """Median seconds per variant and median per-round ratios against ``plain``, after one warm-up round.

    Each round runs every variant once, starting one further along each round (plain, tiled, recompute; tiled,
    recompute, plain; ...), so that no variant always follows the same one."""
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=_DTYPES[dtype], requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(_DTYPES[dtype]).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device)
    variants = _variants(chunk)
    names = list(variants)
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    peaks = dict.fromkeys(names, 0.0)
    for round_index in range(rounds + 1):
        for k in range(len(names)):
            name = names[(round_index + k) % len(names)]
            wall, cpu, peak = _seconds(variants[name], h, w, t)
            peaks[name] = max(peaks[name], peak)
            if round_index:
                times["wall"][name].append(wall)
                times["cpu"][name].append(cpu)
    row: dict = {"chunk_tokens": chunk, "chunks": -(-tokens // chunk)}
    if h.is_cuda:
        row["peak_mib"] = {n: peak / 2**20 for n, peak in peaks.items()}
    for clock, per_name in times.items():
        ratios = {n: [a / b for a, b in zip(per_name[n], per_name["plain"], strict=True)] for n in names}
        row[f"{clock}_median_s"] = {n: statistics.median(values) for n, values in per_name.items()}
        row[f"{clock}_ratio"] = {n: statistics.median(values) for n, values in ratios.items()}
        row[f"{clock}_ratio_range"] = {n: [min(values), max(values)] for n, values in ratios.items()}
    return row


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _markdown(result: dict) -> str:
    setup = result["setup"]
    lines = [
        f"Tiled loss vs plain, forward + backward: {setup['tokens']} tokens, hidden {setup['hidden']}, "
        f"vocab {setup['vocab']}, {setup['dtype']} on {result['machine']} ({setup['threads']} threads), "
        f"torch {result['torch']}, {result['date']}; median of {setup['rounds']} interleaved rounds (ratio: the "
        "median of each round's ratio, its range in brackets; cpu: process CPU time, all threads).",
        "",
        "| clock | chunk tokens | chunks | plain s | tiled s | recompute s | tiled / plain | recompute / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clock in ("wall", "cpu"):
        for row in result["rows"]:
            s, r, span = row[f"{clock}_median_s"], row[f"{clock}_ratio"], row[f"{clock}_ratio_range"]
            lines.append(
                f"| {clock} | {row['chunk_tokens']} | {row['chunks']} | {s['plain']:.3f} | {s['tiled']:.3f} | "
                f"{s['recompute']:.3f} | {r['tiled']:.2f}x ({span['tiled'][0]:.2f}-{span['tiled'][1]:.2f}) | "
                f"{r['recompute']:.2f}x ({span['recompute'][0]:.2f}-{span['recompute'][1]:.2f}) |"
            )
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
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds timed (after one warm-up)")
    parser.add_argument(
        "--chunk-tokens", type=int, nargs="+", default=[0, 512], help="tokens per chunk; 0: the library's default"
    )
    parser.add_argument("--name", default="tiled_loss_speed", help="file name (without suffix) under results/")
    args = parser.parse_args(argv)
    rows = []
    for chunk in args.chunk_tokens:
        chunk = min(chunk or loss_chunk_tokens(args.vocab), args.tokens)
        rows.append(measure(args.tokens, args.hidden, args.vocab, chunk, args.rounds, args.dtype, args.device))
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else _cpu_name()
    result = {
        "machine": f"{device}, {os.cpu_count()} CPUs visible, {platform.system()}",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "setup": {**vars(args), "threads": torch.get_num_threads()},
        "rows": rows,
    }
    save_table(RESULTS, args.name, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
