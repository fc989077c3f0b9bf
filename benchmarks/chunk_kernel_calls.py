"""The attention kernel's time for a rank's heads in one call against the same heads in C calls (one per head chunk).

One rank of Ulysses attends ``--heads`` query heads on ``--kv-heads`` kv heads over the full sequence. Without head
chunks one kernel call takes them all; with C chunks (:mod:`ulysses_sp.head_chunk_pipeline`) each call takes
``heads / C`` query heads and the kv heads they read (a kv group's queries split over chunks read the same kv head
in each). Times the block kernel the chunks use (:mod:`ulysses_sp.chunk_core`: ``cpu_flash`` on the CPU, the CUDA
sdpa ops on a GPU), causal, forward and backward separately, in interleaved rounds; each round's ratio (C calls /
one call) is taken, and the table shows their medians. This is part of what head chunks cost in compute alone,
before any exchange (``ulysses-sp bench`` section 6). Prints a table and saves it as Markdown + JSON under
``benchmarks/results/``.

    python benchmarks/chunk_kernel_calls.py                     # CPU, 1 thread: 4 heads on 1 kv head, C=4
    python benchmarks/chunk_kernel_calls.py --heads 8 --kv-heads 2 --chunks 2 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import save_table
from ulysses_sp.head_split import HeadSplit, head_chunk_choices
from ulysses_sp.ring_kernels import default_ring_kernel, get_ring_kernel

RESULTS = Path(__file__).parent / "results"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _calls(heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """The (query heads, kv heads) of each call: chunk c's queries and the kv heads they read (as the chunks split
    one process's heads: :class:`ulysses_sp.head_split.HeadSplit`)."""
    split = HeadSplit(heads, kv_heads, chunks)
    spans = [(split.query_heads(c), split.kv_heads(c)) for c in range(chunks)]
    return [(slice(q, q + nq), slice(k, k + nk)) for (q, nq), (k, nk) in spans]


def _timed(fn: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, chunks: int) -> dict:
    """Median forward and backward times of one call and of ``chunks`` calls, and the median of per-round ratios."""
    dtype, device = _DTYPES[args.dtype], args.device
    kernel = get_ring_kernel(default_ring_kernel(torch.device(device), dtype, args.head_dim, None))
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, args.heads, args.tokens, args.head_dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, args.kv_heads, args.tokens, args.head_dim, device=device, dtype=dtype, generator=g)
            for _ in range(2))  # fmt: skip
    grad = torch.randn_like(q)
    scale = args.head_dim**-0.5
    plans = {name: _calls(args.heads, args.kv_heads, c) for name, c in (("one call", 1), (f"{chunks} calls", chunks))}
    saved = {name: [kernel.forward(q[:, qs], k[:, ks], v[:, ks], causal=True, scale=scale) for qs, ks in plan]
             for name, plan in plans.items()}  # fmt: skip

    def forward(plan: list) -> None:
        for qs, ks in plan:
            kernel.forward(q[:, qs], k[:, ks], v[:, ks], causal=True, scale=scale)

    def backward(plan: list, outs: list) -> None:
        for (qs, ks), (out, lse) in zip(plan, outs, strict=True):
            kernel.backward(grad[:, qs], q[:, qs], k[:, ks], v[:, ks], out, lse, causal=True, scale=scale)

    times = {(name, part): [] for name in plans for part in ("forward", "backward")}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name in list(plans)[round_ % 2 :] + list(plans)[: round_ % 2]:
            found = {
                "forward": _timed(lambda plan=plans[name]: forward(plan), device),
                "backward": _timed(lambda name=name: backward(plans[name], saved[name]), device),
            }
            for part, seconds in found.items():
                if round_:
                    times[name, part].append(seconds)
    many = f"{chunks} calls"
    return {
        "chunks": chunks,
        "median_s": {f"{name} {part}": statistics.median(t) for (name, part), t in times.items()},
        "ratio": {
            part: statistics.median(a / b for a, b in zip(times[many, part], times["one call", part], strict=True))
            for part in ("forward", "backward")
        },
    }


def _markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"Attention kernel, one call against one per head chunk: {s['heads']} query heads on {s['kv_heads']} kv "
        f"heads, {s['tokens']} tokens, head dim {s['head_dim']}, causal, {s['dtype']} on {result['machine']} "
        f"({s['threads']} threads), torch {result['torch']}, {result['date']}; medians of {s['rounds']} interleaved "
        "rounds (ratio: the median of each round's C calls / one call).",
        "",
        "| C | one call fwd s | C calls fwd s | fwd ratio | one call bwd s | C calls bwd s | bwd ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        m, c = row["median_s"], row["chunks"]
        lines.append(
            f"| {c} | {m['one call forward']:.4f} | {m[f'{c} calls forward']:.4f} | {row['ratio']['forward']:.2f}x | "
            f"{m['one call backward']:.4f} | {m[f'{c} calls backward']:.4f} | {row['ratio']['backward']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=4, help="query heads one rank attends (without chunks)")
    parser.add_argument("--kv-heads", type=int, default=1, help="kv heads one rank reads")
    parser.add_argument("--chunks", type=int, nargs="+", default=[4])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: as each rank of the CPU bench)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="chunk_kernel_calls", help="file name (without suffix) under results/")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    allowed = head_chunk_choices(args.heads, args.kv_heads, 1)
    if bad := [c for c in args.chunks if c not in allowed]:
        raise SystemExit(f"--chunks {bad} do not split {args.heads} heads on {args.kv_heads} kv heads; use {allowed}")
    torch.set_num_threads(args.threads)
    rows = [measure(args, chunks) for chunks in args.chunks]
    env = environment()
    machine = env["gpu"] if args.device.startswith("cuda") else env["machine"]
    result = {"machine": machine, "torch": env["torch"], "date": env["date"], "setup": vars(args), "rows": rows}
    save_table(RESULTS, args.name, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
