"""The tiled-loss benchmark: the tiled lm_head + cross-entropy against the plain loss, forward + backward, same run.

Times ``lm_head`` + ``F.cross_entropy(logits.float())`` (``plain``), the tiled loss (``tiled``: each chunk's
gradient made in the forward, backward only scales) and the tiled loss with ``recompute=True`` (``recompute``: the
logits recomputed in backward, the previous algorithm) on the same inputs. Rounds interleave the variants; each
round's ratio is taken against that round's plain time, and the medians are reported, of wall time and of process
CPU time. Used by ``ulysses-sp bench`` (section 7) and ``benchmarks/tiled_loss_speed.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.tiled_loss import loss_chunk_tokens, tiled_cross_entropy_sum

__all__ = ["DTYPES", "VARIANTS", "measure", "measure_chunks", "table_lines"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("plain", "tiled", "recompute")


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
    """Median seconds per variant and median per-round ratios against ``plain`` (with their ranges), after one
    warm-up round, for ``chunk`` tokens a chunk.

    Each round runs every variant once, starting one further along each round (plain, tiled, recompute; tiled,
    recompute, plain; ...), so that no variant always follows the same one."""
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=DTYPES[dtype], requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(DTYPES[dtype]).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device)
    variants = _variants(chunk)
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in VARIANTS}, "cpu": {n: [] for n in VARIANTS}}
    peaks = dict.fromkeys(VARIANTS, 0.0)
    for round_index in range(rounds + 1):
        for k in range(len(VARIANTS)):
            name = VARIANTS[(round_index + k) % len(VARIANTS)]
            wall, cpu, peak = _seconds(variants[name], h, w, t)
            peaks[name] = max(peaks[name], peak)
            if round_index:
                times["wall"][name].append(wall)
                times["cpu"][name].append(cpu)
    row: dict = {"chunk_tokens": chunk, "chunks": -(-tokens // chunk)}
    if h.is_cuda:
        row["peak_mib"] = {n: peak / 2**20 for n, peak in peaks.items()}
    for clock, per_name in times.items():
        ratios = {n: [a / b for a, b in zip(per_name[n], per_name["plain"], strict=True)] for n in VARIANTS}
        row[f"{clock}_median_s"] = {n: statistics.median(values) for n, values in per_name.items()}
        row[f"{clock}_ratio"] = {n: statistics.median(values) for n, values in ratios.items()}
        row[f"{clock}_ratio_range"] = {n: [min(values), max(values)] for n, values in ratios.items()}
    return row


def measure_chunks(
    tokens: int, hidden: int, vocab: int, chunk_tokens: list[int], rounds: int, dtype: str, device: str, log=None
) -> list[dict[str, Any]]:
    """:func:`measure` for each of ``chunk_tokens`` (0: the library's default for ``vocab``; capped at ``tokens``),
    each row passed to ``log`` as it is measured."""
    if min(tokens, hidden, vocab, rounds) < 1 or not chunk_tokens or min(chunk_tokens) < 0:
        raise ValueError(
            f"tiled-loss benchmark: tokens, hidden, vocab and rounds must be >= 1 and chunk tokens >= 0 (0: the "
            f"default), got tokens {tokens}, hidden {hidden}, vocab {vocab}, rounds {rounds}, chunk tokens "
            f"{chunk_tokens}"
        )
    rows = []
    for chunk in chunk_tokens:
        size = min(chunk or loss_chunk_tokens(vocab), tokens)
        rows.append(measure(tokens, hidden, vocab, size, rounds, dtype, device))
        if log is not None:
            log(rows[-1])
    return rows


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of :func:`measure`'s rows: per clock (wall, then CPU) and chunk size, the median seconds
    and the ratios against the plain loss with their ranges."""
    lines = [
        "| clock | chunk tokens | chunks | plain s | tiled s | recompute s | tiled / plain | recompute / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clock in ("wall", "cpu"):
        for row in rows:
            s, r, span = row[f"{clock}_median_s"], row[f"{clock}_ratio"], row[f"{clock}_ratio_range"]
            lines.append(
                f"| {clock} | {row['chunk_tokens']} | {row['chunks']} | {s['plain']:.3f} | {s['tiled']:.3f} | "
                f"{s['recompute']:.3f} | {r['tiled']:.2f}x ({span['tiled'][0]:.2f}-{span['tiled'][1]:.2f}) | "
                f"{r['recompute']:.2f}x ({span['recompute'][0]:.2f}-{span['recompute'][1]:.2f}) |"
            )
    return lines
