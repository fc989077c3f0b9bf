"""What one head-chunked train step runs, counted: aten ops, the library's Python calls and all-to-alls, C=1 vs C=4.

One train step (forward + backward) of ``llama-bench-heads`` (16 heads, 4 kv heads, 2 layers) in one process standing
in for rank 0 of sp = ``--sp`` (a fake process group: each exchange a local copy, so the counts depend on the code
only, not on the machine's load), with C=1 and C=4, plain and with checkpointed decoder layers, each after one
uncounted step (the chunked modules' probe runs at the first). Counted in one more step each:

* aten ops dispatched (a ``TorchDispatchMode``: every op that reaches a kernel, forward and backward, per op name);
* Python calls (``cProfile``'s call counts): all of them, and those of functions in ``ulysses_sp``'s own modules;
* all-to-alls (:class:`ulysses_sp.CommStats`).

The counts are what the chunks' fixed cost is made of (``benchmarks/chunk_fixed_cost.py`` times it). Prints the
totals and the ops whose counts differ most between C=1 and C=4, and saves both as Markdown + JSON under
``benchmarks/results/``.

    python benchmarks/chunk_op_counts.py                      # sp=4, 256 tokens
    python benchmarks/chunk_op_counts.py --sp 2 --tokens 1024
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ulysses_sp
from ulysses_sp import CommStats
from ulysses_sp.bench.headchunks import HEAD_CHUNK_MODEL, _variants, variant_name
from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import md_table, save_table
from ulysses_sp.shapes import SHAPES
from ulysses_sp.standin import StandIn, random_batch

RESULTS = Path(__file__).parent / "results"
LIBRARY = str(Path(ulysses_sp.__file__).parent)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, by overload packet name (``aten.mm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_step(variant: Any, stats: CommStats) -> dict[str, Any]:
    """The aten ops, Python calls and all-to-alls of one step of ``variant``."""
    stats.reset()
    counter, profiler = OpCounter(), cProfile.Profile()
    with counter:  # the ops in one step, the Python calls in another (the counter's own calls left out)
        variant.loss_and_grads()
    all_to_alls = stats.calls["all_to_all"]
    profiler.enable()
    variant.loss_and_grads()
    profiler.disable()
    calls: Counter = Counter()
    for (filename, _, name), row in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        if filename.startswith(LIBRARY):
            calls[f"{Path(filename).stem}.{name}"] += row[1]  # (primitive calls, total calls, ...)
    total_calls = sum(row[1] for row in pstats.Stats(profiler).stats.values())  # type: ignore[attr-defined]
    return {
        "aten_ops": sum(counter.ops.values()),
        "python_calls": total_calls,
        "library_calls": sum(calls.values()),
        "all_to_alls": all_to_alls,
        "ops": dict(counter.ops),
        "library": dict(calls),
    }


def counts(sp: int, tokens: int) -> dict[str, dict[str, Any]]:
    """``{variant name: count_step(...)}`` for C=1 and C=4, plain and checkpointed."""
    torch.set_num_threads(1)
    with StandIn(sp=sp, sp_rank=0) as rank:
        batch = random_batch(SHAPES[HEAD_CHUNK_MODEL]["vocab_size"], tokens, seed=1)
        stats = CommStats()
        variants = _variants(rank.layout, rank.shard(batch), tokens, stats)
        found = {}
        for name, variant in variants.items():
            variant.loss_and_grads()  # the probe, and first-call caches
            found[name] = count_step(variant, stats)
        return found


def _markdown(result: dict[str, Any], top: int) -> str:
    s, found = result["setup"], result["counts"]
    env = result["environment"]
    lines = [
        f"One train step (forward + backward) of `{HEAD_CHUNK_MODEL}` (2 layers), {s['tokens']} tokens, in one process "
        f"standing in for rank 0 of sp = {s['sp']} (fake process group), counted: {env['machine']}, torch "
        f"{env['torch']}, transformers {env['transformers']}, Python {env['python']}, ulysses-sp "
        f"{env['ulysses_sp_commit']}, {env['date']}.",
        "",
    ]
    rows = [
        [name, f"{c['aten_ops']:,}", f"{c['python_calls']:,}", f"{c['library_calls']:,}", c["all_to_alls"]]
        for name, c in found.items()
    ]
    lines += md_table(["variant", "aten ops", "Python calls", "ulysses_sp calls", "all-to-alls"], rows)
    for checkpointed in (False, True):
        one, four = found[variant_name(1, checkpointed)], found[variant_name(4, checkpointed)]
        layers = "checkpointed" if checkpointed else "plain"
        for key, label in (("ops", "aten op"), ("library", "ulysses_sp function")):
            names = sorted(set(one[key]) | set(four[key]), key=lambda n: -abs(four[key].get(n, 0) - one[key].get(n, 0)))
            rows = [[n, one[key].get(n, 0), four[key].get(n, 0), four[key].get(n, 0) - one[key].get(n, 0)]
                    for n in names[:top]]  # fmt: skip
            lines += [f"{layers} layers, the {top} {label}s whose counts differ most:", ""]
            lines += md_table([label, "C=1", "C=4", "C=4 - C=1"], rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, default=4, help="the sp degree rank 0 stands in for")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=15, help="ops and functions listed (those that differ most)")
    parser.add_argument("--name", default="chunk_op_counts", help="file name (without suffix) under --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.tokens % args.sp:
        raise SystemExit(f"--tokens {args.tokens} must be a positive multiple of --sp {args.sp}")
    result = {
        "environment": environment(),
        "setup": {k: str(v) for k, v in vars(args).items()},
        "counts": counts(args.sp, args.tokens),
    }
    save_table(args.out, args.name, result, _markdown(result, args.top))
    return result


if __name__ == "__main__":
    main()
