"""Where a head-chunked step's compute goes: one train step's forward + backward with C=1 and with C=4, profiled op
by op (``torch.profiler``, each op's own CPU time), in one process standing in for rank 0 of sp = ``--sp`` (a fake
process group: each exchange a local copy; ``ulysses-sp bench`` section 6's 'compute alone'), on one thread as each
rank of the CPU bench has. Prints the ops whose time differs most between the two and saves the table as Markdown +
JSON under ``benchmarks/results/``. One step each: a look at where the time goes, not a ratio (section 6 has those).

    python benchmarks/chunk_step_profile.py --sp 4 --tokens 16384
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ulysses_sp import CommStats
from ulysses_sp.bench.headchunks import HEAD_CHUNK_MODEL, _variants, variant_name
from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import md_table, save_table
from ulysses_sp.shapes import SHAPES
from ulysses_sp.standin import StandIn, random_batch

RESULTS = Path(__file__).parent / "results"


def op_times(sp: int, tokens: int, checkpointed: bool) -> dict[str, dict[str, float]]:
    """``{variant: {op: its own CPU seconds in one profiled step}}`` for C=1 and C=4 (each after one unprofiled
    step)."""
    with StandIn(sp=sp, sp_rank=0) as rank:
        batch = random_batch(SHAPES[HEAD_CHUNK_MODEL]["vocab_size"], tokens, seed=1)
        variants = _variants(rank.layout, rank.shard(batch), tokens, CommStats())
        found = {}
        for chunks in (1, 4):
            variant = variants[variant_name(chunks, checkpointed)]
            variant.loss_and_grads()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                variant.loss_and_grads()
            found[f"C={chunks}"] = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
        return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, default=4, help="the sp degree rank 0 stands in for")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--checkpointed", action="store_true", help="activation checkpointing of the decoder layers")
    parser.add_argument("--top", type=int, default=12, help="ops listed (those whose time differs most)")
    parser.add_argument("--name", default="chunk_step_profile", help="file name (without suffix) under results/")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    times = op_times(args.sp, args.tokens, args.checkpointed)
    one, four = times["C=1"], times["C=4"]
    ops = sorted(set(one) | set(four), key=lambda op: -abs(four.get(op, 0.0) - one.get(op, 0.0)))[: args.top]
    rows = [
        [op, f"{one.get(op, 0.0):.3f}", f"{four.get(op, 0.0):.3f}", f"{four.get(op, 0.0) - one.get(op, 0.0):+.3f}"]
        for op in ops
    ]
    rows.append(
        [
            "all ops",
            f"{sum(one.values()):.3f}",
            f"{sum(four.values()):.3f}",
            f"{sum(four.values()) - sum(one.values()):+.3f}",
        ]
    )
    env = environment()
    result = {
        "machine": env["machine"],
        "torch": env["torch"],
        "date": env["date"],
        "setup": vars(args),
        "op_self_cpu_s": times,
    }
    layers = "checkpointed" if args.checkpointed else "plain"
    heading = (
        f"One train step (forward + backward) of `{HEAD_CHUNK_MODEL}`, {args.tokens} tokens, {layers} layers, in "
        f"one process standing in for rank 0 of sp = {args.sp} (one thread), profiled op by op: each op's own CPU "
        f"seconds with C=1 and C=4; {result['machine']}, torch {result['torch']}, {result['date']}."
    )
    markdown = "\n".join([heading, "", *md_table(["op", "C=1 s", "C=4 s", "C=4 - C=1 s"], rows)]) + "\n"
    save_table(RESULTS, args.name, result, markdown)
    return result


if __name__ == "__main__":
    main()
