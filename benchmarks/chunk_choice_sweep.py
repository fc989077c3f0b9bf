"""Where the automatic head-chunk count is not the planner's lowest-peak one, over a grid of attention shapes.

Where no chunk count C's q/k/v after the exchange fit the budget (1 GiB per rank), the attention takes the C of the
planner's lowest attention peak (:func:`ulysses_sp.plan.attention.choose_head_chunks`). This sweep checks that
choice against the whole plan: for each shape (heads and head dim, kv heads, ulysses x ring degree, sequence length;
16 layers, hidden = heads x head dim, MLP 4 x hidden, bf16 on CUDA unless a feature set says otherwise, and
Llama-3.1-8B), it plans one step with automatic C and with every allowed C (:func:`ulysses_sp.plan.plan_memory`), and
counts a miss where automatic C plans more than 0.5% above the lowest. Shapes where some C fits the budget are left
out (the budget, not the peak, chooses there). Feature sets: the defaults, and ones that change what the rule must
see of the decoder layer around the attention (:class:`ulysses_sp.plan.attention.LayerMemory`: checkpoint instead of
offload, fp32, untiled norms, no activation checkpointing: every layer's saved tensors). A prediction of the planner
alone: no GPU runs here.

Prints and saves ``benchmarks/results/chunk_choice_sweep.{json,md}``: per feature set the over-budget shapes and the
misses, and each miss (the planned peak of automatic C against the lowest).

    python benchmarks/chunk_choice_sweep.py            # the full grid (about 15 s on 2 CPU cores)
    python benchmarks/chunk_choice_sweep.py --quick    # 2M and 8M tokens only (about 7 s)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ulysses_sp.bench.runner import environment
from ulysses_sp.bench.tables import md_table, save_table
from ulysses_sp.features import Features
from ulysses_sp.head_split import DEFAULT_HEAD_CHUNK_BUDGET_BYTES, chunk_exchange_bytes, head_chunk_choices
from ulysses_sp.plan import GiB, ModelShape, model_shape, plan_memory
from ulysses_sp.plan.memory import planned_layer

RESULTS = Path(__file__).parent / "results"
HEADS = ((8, 128), (16, 128), (24, 128), (32, 128), (40, 128), (64, 128), (16, 64), (32, 64))  # (heads, head dim)
ULYSSES, RINGS = (2, 4, 8), (1, 2, 4, 16)
FEATURE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "checkpoint (not offload)": {"activation_checkpointing": "checkpoint"},
    "fp32": {"dtype": "fp32"},
    "untiled norms": {"tiled_norms": False},
    "no activation checkpointing": {"activation_checkpointing": "none"},
}


def _shape(heads: int, kv_heads: int, head_dim: int) -> ModelShape:
    hidden = heads * head_dim
    return ModelShape(
        hidden_size=hidden, num_layers=16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=4 * hidden, vocab_size=32000, tie_word_embeddings=False,
        name=f"H{heads}/kv{kv_heads}/d{head_dim}",
    )  # fmt: skip


def grid(lengths: tuple[int, ...]) -> list[tuple[ModelShape, int, int, int]]:
    """(shape, ulysses, ring, tokens) of every shape whose heads split over ulysses into more than one C."""
    found = []
    for heads, head_dim in HEADS:
        for kv in sorted({k for k in (1, 2, 4, 8, heads) if heads % k == 0}):
            for ulysses in ULYSSES:
                if len(head_chunk_choices(heads, kv, ulysses)) > 1:
                    found += [(_shape(heads, kv, head_dim), ulysses, r, n) for r in RINGS for n in lengths]
    llama = model_shape("llama-3.1-8b")
    for ulysses, ring in ((8, 1), (2, 16), (4, 4), (8, 2), (2, 4), (4, 1), (2, 2)):
        found += [(llama, ulysses, ring, n) for n in lengths]
    return found


def compare(shape: ModelShape, ulysses: int, ring: int, tokens: int, extra: dict[str, Any]) -> dict[str, Any] | None:
    """Automatic C against the lowest planned peak of every C, or None where some C fits the budget (or the layout
    is refused)."""
    args = dict(seq_len=tokens, sp=ulysses * ring, ring=ring, device="cuda")
    try:
        auto = plan_memory(shape, **args, features=Features(**extra))
    except ValueError:
        return None
    choices = head_chunk_choices(shape.num_heads, shape.num_kv_heads, ulysses)
    element_size, _ = planned_layer(shape, auto.features)
    sizes = dict(tokens=auto.tokens_per_rank * ulysses, head_dim=shape.head_dim, element_size=element_size)
    budget = DEFAULT_HEAD_CHUNK_BUDGET_BYTES
    if any(chunk_exchange_bytes(shape.num_heads, shape.num_kv_heads, ulysses, c, **sizes) <= budget for c in choices):
        return None
    peaks = {c: plan_memory(shape, **args, features=Features(**extra, head_chunks=c)).peak_bytes for c in choices}
    best = min(peaks, key=lambda c: (peaks[c], c))
    return {
        "shape": shape.name, "ulysses": ulysses, "ring": ring, "tokens": tokens, "auto": auto.head_chunks,
        "best": best, "peaks_gib": {c: round(p / GiB, 2) for c, p in peaks.items()},
        "miss": peaks[auto.head_chunks] > peaks[best] * 1.005,
    }  # fmt: skip


def _markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        "Automatic head chunks against the planner's lowest-peak C where no C fits the 1 GiB budget "
        f"(benchmarks/chunk_choice_sweep.py; planner predictions, 16 layers, CUDA): {env['machine']}, torch "
        f"{env['torch']}, transformers {env['transformers']}, Python {env['python']}, ulysses-sp "
        f"{env['ulysses_sp_commit']}, {env['date']}.",
        "",
    ]
    rows = [[name, f"{s['over_budget']:,}", s["misses"]] for name, s in result["sets"].items()]
    lines += md_table(["features", "over-budget shapes", "misses (> 0.5% above the lowest)"], rows)
    for name, s in result["sets"].items():
        if s["missed"]:
            lines += [f"{name}: the misses (planned GiB per rank of each C)", ""]
            rows = [
                [m["shape"], f"{m['ulysses']} x {m['ring']}", f"{m['tokens']:,}", m["auto"], m["best"],
                 " ".join(f"{c}: {g}" for c, g in m["peaks_gib"].items())]
                for m in s["missed"]
            ]  # fmt: skip
            lines += md_table(["shape", "ulysses x ring", "tokens", "auto C", "lowest C", "peaks"], rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2M and 8M tokens only")
    parser.add_argument("--name", default="chunk_choice_sweep", help="file name (without suffix) under --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    lengths = (1 << 21, 1 << 23) if args.quick else (1 << 21, 1 << 23, 1 << 25)
    shapes = grid(lengths)
    sets = {}
    for name, extra in FEATURE_SETS.items():
        found = [r for shape in shapes if (r := compare(*shape, extra)) is not None]
        missed = [r for r in found if r["miss"]]
        sets[name] = {"features": extra, "over_budget": len(found), "misses": len(missed), "missed": missed}
        print(f"{name}: {len(missed)} misses of {len(found)} over-budget shapes", flush=True)
    result = {"environment": environment(), "setup": {"tokens": list(lengths), "shapes": len(shapes)}, "sets": sets}
    save_table(args.out, args.name, result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
