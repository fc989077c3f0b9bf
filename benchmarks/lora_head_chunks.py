"""Step time of a PEFT LoRA model in head chunks (C > 1) against the same model unchunked (C = 1), with and without
LoRA dropout.

One process (sp = 1: the chunks' exchanges are local copies), a Llama-shaped model (``--hidden``, ``--heads`` on
``--kv-heads``, ``--layers``) with LoRA (rank ``--rank``) on q/k/v/o, training mode; one step is a forward and a
backward of the sequence-parallel loss. Every (dropout, C) runs once per round, in interleaved rounds after a
warm-up round; each round's ratio (C / C = 1, at the same dropout) is taken and the table shows their medians and
spread. On CUDA the peak memory of each step is added. This is what LoRA costs the chunks in compute alone
(:mod:`ulysses_sp.head_chunk_lora`: the adapters' input work made once per call, their dropout a position hash).
Prints a table and saves it as Markdown + JSON under ``benchmarks/results/``.

    python benchmarks/lora_head_chunks.py                       # CPU, 1 thread, 4,096 tokens, C = 4, p = 0 / 0.1
    python benchmarks/lora_head_chunks.py --tokens 8192 --chunks 2 4 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

import ulysses_sp as U
from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import save_table

RESULTS = Path(__file__).parent / "results"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _models(args: argparse.Namespace) -> dict[tuple[float, int], torch.nn.Module]:
    """The same LoRA model (same weights) parallelized at each (dropout, C)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(args.device, _DTYPES[args.dtype])
    layout = U.ParallelLayout.single(torch.device(args.device))
    found = {}
    for dropout in ([None] if args.plain else []) + args.dropout:
        for chunks in (1, *args.chunks):
            if dropout is None:  # the same model without adapters: what the chunks cost without LoRA
                found[dropout, chunks] = U.parallelize(copy.deepcopy(base), layout, head_chunks=chunks).train()
                continue
            torch.manual_seed(1)
            lora = LoraConfig(
                r=args.rank,
                lora_alpha=2 * args.rank,
                lora_dropout=dropout,
                init_lora_weights=False,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            )
            model = U.parallelize(get_peft_model(copy.deepcopy(base), lora), layout, head_chunks=chunks)
            found[dropout, chunks] = model.train()
    return found


def _step(model: torch.nn.Module, shard: dict, layout: U.ParallelLayout, device: str) -> tuple[float, float | None]:
    """Seconds of one forward + backward, and the peak memory in GiB on CUDA (None elsewhere)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def _profile(model: torch.nn.Module, shard: dict, layout: U.ParallelLayout, device: str) -> dict:
    """One profiled step: its wall time, the device's busy time (its kernels' and copies' own time, summed over
    every stream), the kernels and copies launched, and the ops that took the most device time. On CPU the 'device'
    is the CPU ops' own time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        seconds, _ = _step(model, shard, layout, device)
    # the ops (CPU events); on CUDA an op's own device time is that of the kernels it launched itself
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    kernels = [e for e in prof.events() if cuda and e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(events, key=own, reverse=True)[:12]
    return {
        "wall_s": seconds,
        "device_busy_s": sum(own(e) for e in events) / 1e6,
        "kernels": len(kernels) if cuda else sum(e.count for e in events),
        "top": [{"op": e.key, "calls": e.count, "own_ms": own(e) / 1e3} for e in top],
    }


def measure(args: argparse.Namespace) -> list[dict]:
    models = _models(args)
    layout = U.ParallelLayout.single(torch.device(args.device))
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(2))
    shard = {k: v.to(args.device) for k, v in U.shard_batch({"input_ids": ids, "labels": ids}, layout).items()}
    times = {key: [] for key in models}
    peaks = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        keys = list(models)[round_ % len(models) :] + list(models)[: round_ % len(models)]
        for key in keys:
            seconds, peak = _step(models[key], shard, layout, args.device)
            if round_:
                times[key].append(seconds)
                peaks[key] = peak
    profiles = {key: _profile(m, shard, layout, args.device) for key, m in models.items()} if args.profile else {}
    rows = []
    for (dropout, chunks), found in times.items():
        ratios = sorted(a / b for a, b in zip(found, times[dropout, 1], strict=True))
        rows.append(
            {
                "dropout": dropout,
                "chunks": chunks,
                "median_s": statistics.median(found),
                "ratio": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
                "peak_gib": peaks[dropout, chunks],
                "profile": profiles.get((dropout, chunks)),
            }
        )
    return rows


def _markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"LoRA (r {s['rank']} on q/k/v/o) in head chunks against C = 1: Llama-shaped, hidden {s['hidden']}, "
        f"{s['heads']} heads on {s['kv_heads']} kv heads, {s['layers']} layers, {s['tokens']} tokens, sp = 1, "
        f"{s['dtype']} on {result['machine']} ({s['threads']} threads), torch {result['torch']}, peft "
        f"{result['peft']}, {result['date']}; medians of {s['rounds']} interleaved rounds (ratio: each round's "
        "C / C = 1 at the same dropout).",
        "",
        "| lora_dropout | C | step s | ratio to C = 1 (min-max) | peak GiB | profiled: wall s | busy s | launched |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        r, p = row["ratio"], row["profile"]
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        prof = "- | - | -" if p is None else f"{p['wall_s']:.3f} | {p['device_busy_s']:.3f} | {p['kernels']}"
        lora = "no LoRA" if row["dropout"] is None else row["dropout"]
        lines.append(
            f"| {lora} | {row['chunks']} | {row['median_s']:.3f} | {r['median']:.3f}x "
            f"({r['min']:.3f}-{r['max']:.3f}) | {peak} | {prof} |"
        )
    for row in result["rows"]:
        if row["profile"]:
            lora = "no LoRA" if row["dropout"] is None else f"lora_dropout {row['dropout']}"
            lines += ["", f"Most device time, {lora}, C = {row['chunks']} (one profiled step):", ""]
            lines += ["| op | calls | own ms |", "|---|---:|---:|"]
            lines += [f"| {t['op'][:60]} | {t['calls']} | {t['own_ms']:.2f} |" for t in row["profile"]["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4])
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--plain", action="store_true", help="also time the model without adapters at each C")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step of each: busy time, launches, top ops"
    )
    parser.add_argument("--name", default="lora_head_chunks", help="file name (without suffix) under results/")
    args = parser.parse_args(argv)
    if bad := [c for c in args.chunks if c < 2]:
        raise SystemExit(f"--chunks {bad}: give chunk counts of 2 or more (C = 1 is always measured)")
    if bad := [p for p in args.dropout if not 0 <= p < 1]:
        raise SystemExit(f"--dropout {bad}: give probabilities in [0, 1)")
    torch.set_num_threads(args.threads)
    import peft

    rows = measure(args)
    env = environment()
    machine = env["gpu"] if args.device.startswith("cuda") else env["machine"]
    result = {
        "machine": machine,
        "torch": env["torch"],
        "peft": peft.__version__,
        "date": env["date"],
        "setup": vars(args),
        "rows": rows,
    }
    save_table(RESULTS, args.name, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
