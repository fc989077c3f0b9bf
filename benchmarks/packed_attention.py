"""Packed rows: what one attention layer's core costs as a row holds more, shorter documents.

For each (row length, documents per row) it times, in the same run on the same device, forward + backward of:

* ``per_document``: the sdpa core's loop, one ``scaled_dot_product_attention`` call per document;
* ``auto``: the sdpa core as it runs by default (on CUDA with many documents: one ``flex_attention`` call
  with a document ``BlockMask``, see ``ulysses_sp.cores.packed_kernel``; elsewhere the same loop);
* ``one_call``: a single causal sdpa call over the whole row, ignoring documents: not exact for packed rows,
  the floor that "one call per layer" aims at.

Ratios are against ``per_document`` measured in the same run (no absolute times from a shared machine are
compared across runs). Prints a table and saves it as Markdown + JSON under ``benchmarks/results/``.

    python benchmarks/packed_attention.py                 # CPU: tiny sizes, the loop only (auto == loop)
    python benchmarks/packed_attention.py --seq-len 32768 --docs 1 8 64 256   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ulysses_sp.cores import Segments, _per_document, packed_kernel, sdpa_core


def _positions(batch: int, seq_len: int, docs: int, device: torch.device) -> torch.Tensor:
    # docs documents of (nearly) equal length per row: positions restart at 0 at each document
    lengths = [seq_len // docs + (1 if i < seq_len % docs else 0) for i in range(docs)]
    return torch.cat([torch.arange(n) for n in lengths]).to(device).expand(batch, seq_len)


def _time(fn, q, k, v, repeats: int) -> float:
    """Median seconds of forward + backward (after one warm-up call, which also compiles on CUDA)."""
    times = []
    for i in range(repeats + 1):
        for x in (q, k, v):
            x.grad = None
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        if q.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    gqa = args.heads != args.kv_heads
    for seq_len in args.seq_len:
        for docs in args.docs:
            gen = torch.Generator(device="cpu").manual_seed(0)
            shape_q = (args.batch, args.heads, seq_len, args.head_dim)
            shape_kv = (args.batch, args.kv_heads, seq_len, args.head_dim)
            q, k, v = (
                torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv)
            )
            segments = Segments.from_positions(_positions(args.batch, seq_len, docs, device))

            def loop(q, k, v, segments=segments):
                def attend(qd, kd, vd):
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)

                return _per_document(q, k, v, segments, attend)

            def auto(q, k, v, segments=segments):
                return sdpa_core(q, k, v, segments)

            def one_call(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            row = {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "seq_len": seq_len,
                "docs_per_row": docs,
                "auto_kernel": packed_kernel(segments, device, args.head_dim) if docs > 1 else "one_call",
            }
            for name, fn in (("per_document", loop), ("auto", auto), ("one_call", one_call)):
                row[f"{name}_ms"] = 1e3 * _time(fn, q, k, v, args.repeats)
            row["auto_vs_loop"] = row["auto_ms"] / row["per_document_ms"]
            row["one_call_vs_loop"] = row["one_call_ms"] / row["per_document_ms"]
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


HEADER = (
    "| device | N | docs/row | auto kernel | per-document ms | auto ms | one call ms | auto / loop | one call / loop |"
)


def _format_row(r: dict) -> str:
    return (
        f"| {r['device']} | {r['seq_len']} | {r['docs_per_row']} | {r['auto_kernel']} | {r['per_document_ms']:.2f} "
        f"| {r['auto_ms']:.2f} | {r['one_call_ms']:.2f} | {r['auto_vs_loop']:.2f} | {r['one_call_vs_loop']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None, help="row lengths (tokens)")
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 4, 16, 64], help="documents per row")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads on this rank (H/P)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.seq_len is None:
        args.seq_len = [8192, 32768] if args.device.startswith("cuda") else [1024, 4096]
    print("\n" + HEADER + "\n" + "|---" * 9 + "|", flush=True)
    rows = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"packed_attention_{'cuda' if args.device.startswith('cuda') else 'cpu'}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    table = "\n".join([HEADER, "|---" * 9 + "|", *(_format_row(r) for r in rows)])
    stem.with_suffix(".md").write_text(f"# Packed attention, one layer's core (fwd + bwd)\n\n{table}\n")
    print(f"saved {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
