"""BENCHMARKS.md from a run's results: tables and plots, each with the command, machine, versions and date."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report_chunks import head_chunks_section, tiled_loss_section
from .tables import md_table, ratio_rows

__all__ = ["render_markdown", "write_markdown"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _load_lines(results: dict[str, Any]) -> list[str]:
    env, note = results["environment"], results["config"].get("note")
    lines = [f"- Note: {note}"] if note else []
    start, end = env.get("load_average_start"), env.get("load_average_end")
    if start is not None and end is not None:
        lines.append(
            f"- Load average (1 min) {start:.1f} at the start and {end:.1f} at the end of the run: when it exceeds the "
            "core count, other processes shared the CPUs, so absolute times are noisy; the ratios come from "
            "interleaved repetitions in the same run"
        )
    return lines


def _provenance(results: dict[str, Any]) -> list[str]:
    env, config = results["environment"], results["config"]
    versions = (
        f"torch {env['torch']}, transformers {env['transformers']}, deepspeed {env['deepspeed'] or 'not installed'}"
    )
    rendered = []
    if "rendered_by" in results:
        rendered = [f"- Report redrawn from the run's results.json by `{results['rendered_by']}`"]
    return [
        f"- Command: `{config['command']}` (total {results['wall_s']:.0f} s)",
        *rendered,
        f"- Machine: {env['machine']}; GPU: {env['gpu'] or 'none'}",
        *_load_lines(results),
        f"- Versions: Python {env['python']}, {versions}; ulysses-sp commit {env['ulysses_sp_commit'] or 'unknown'}",
        f"- Date: {env['date']}",
        "",
    ]


def _memory(results: dict[str, Any], image: str) -> list[str]:
    config = results["config"]
    rows = results["memory"]
    sps = sorted({r["sp"] for r in rows})
    seq_lens = sorted({r["seq_len"] for r in rows})
    by = {(r["sp"], r["seq_len"]): r for r in rows}
    header = ["tokens"] + [f"sp={sp} saved MiB" for sp in sps] + [f"sp={sp} peak MiB" for sp in sps]
    table = [
        [f"{n:,}"] + [_mib(by[sp, n]["saved_bytes"]) for sp in sps] + [_mib(by[sp, n]["peak_bytes"]) for sp in sps]
        for n in seq_lens
    ]
    check = []
    for world, result in results["worlds"].items():
        standin = by.get((int(world), result["seq_len"]))
        if standin is not None:
            real = result["rank_memory"]
            check.append(
                f"Check: a real gloo rank of the sp={world} world at {result['seq_len']:,} tokens saved "
                f"{real['saved_bytes']:,} bytes (stand-in: {standin['saved_bytes']:,}) and peaked at "
                f"{real['peak_bytes']:,} bytes (stand-in: {standin['peak_bytes']:,})."
            )
    return [
        "## 1. Per-rank activation memory vs sequence length",
        "",
        f"Model `{config['model']}` (fp32, CPU), one training step (forward, loss, backward) on the last rank of "
        "an sp-rank group. `saved` = bytes autograd keeps for backward (saved_tensors_hooks, each storage once, "
        "parameters excluded); `peak` = the step's peak above what was allocated before it (activations, "
        "gradients, temporaries; `ulysses_sp.memory.PeakMemory`). sp > 1 is measured in one process standing in "
        "for one rank with torch's fake process group (memory depends on shapes only).",
        "",
        *md_table(header, table),
        *(line + "\n" for line in check),
        f"![memory]({image})",
        "",
    ]


def _comm(results: dict[str, Any], image: str) -> list[str]:
    rows = []
    for r in results["comm"]:
        if r["implementation"] == "ulysses formula":
            continue
        p2p = r.get("p2p_bytes_per_layer")
        rows.append(
            [
                r["sp"],
                r["implementation"],
                r["source"],
                f"{r.get('all_to_all_per_layer', 0):g}",
                _mib(r.get("all_to_all_bytes_per_layer", 0)),
                f"{r.get('p2p_sends_per_layer', 0):g}",
                _mib(p2p) if p2p is not None else "0",
                f"{r.get('all_gather_per_step', 0)} ({r.get('all_gather_bytes_per_step', 0):,} B)",
            ]
        )
    formula = {
        r["sp"]: r["all_to_all_bytes_per_layer"] for r in results["comm"] if r["implementation"] == "ulysses formula"
    }
    measured = {
        r["sp"]: r["all_to_all_bytes_per_layer"] for r in results["comm"] if r["implementation"] == "ulysses-sp"
    }
    checks = [
        f"sp={sp}: measured {measured[sp]:,.0f} B/layer, formula {formula[sp]:,} B/layer"
        for sp in sorted(measured)
        if sp in formula
    ]
    world = next(iter(results["worlds"].values()))
    return [
        "## 2. Collectives and bytes per attention layer",
        "",
        f"Same model, {world['seq_len']:,} tokens, batch 1, fp32, one forward + backward, per rank. ulysses-sp and "
        "DeepSpeed are counted by the same counter (a TorchDispatchMode that sees every c10d collective, and "
        "DeepSpeed's `deepspeed::dim_zero_all_to_all` operator; `ulysses-sp ring` is ulysses-sp's ring "
        "attention over the same P ranks, its point-to-point sends counted by the same counter). `ring "
        "attention` is the **formula** for a ring (forward: P-1 steps passing k and v; backward: k/v again "
        "plus fp32 gradient accumulators, P hops), which the measured ring row should match. All-gathers are "
        "per step (whole model): ulysses-sp gathers shapes and positions once per forward, DeepSpeed gathers "
        "position_ids in every layer. The loss all-reduce (2 per step) is the same for all and not listed.",
        "",
        *md_table(
            [
                "P",
                "implementation",
                "source",
                "all-to-alls / layer",
                "all-to-all MiB / layer",
                "p2p sends / layer",
                "p2p MiB / layer",
                "all-gathers / step (bytes)",
            ],
            rows,
        ),
        "ulysses-sp all-to-all bytes against the formula `2 (b n d (H + 2 hkv P) + b n H d) e`: " + "; ".join(checks),
        "",
        f"![communication]({image})",
        "",
    ]


def _agreement_rows(result: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            name,
            f"{a['loss_abs_diff']:.2e}",
            f"{a['grad_max_abs_diff']:.2e}",
            f"{a['grad_max_rel_diff']:.2e}",
            a["params_compared"],
        ]
        for name, a in result["agreement"].items()
    ]


def _steps(results: dict[str, Any], image: str) -> list[str]:
    lines = [
        "## 3. Train-step time against DeepSpeed's UlyssesSPAttentionHF, and agreement",
        "",
        "One gloo world per P on the CPU; in it the same model is built from the same seed for each "
        "implementation. A step = forward, the same token-weighted loss, backward, one gradient all-reduce over "
        "the world, AdamW. Repetitions are interleaved (every implementation once per repetition, rotating order, "
        "barriers around each step), after one warm-up; the ratio is taken per repetition and its median (min-max) "
        "is reported. DeepSpeed's attention runs without a ZeRO engine: its SP attention does not need one "
        "(ZeRO is what its Trainer integrations shard the model with), and leaving it out on both sides keeps "
        "the difference to the SP attention itself.",
        "",
        "DeepSpeed set-up (0.19, CPU, gloo; `DS_BUILD_OPS=0 pip install deepspeed`): "
        '`deepspeed.init_distributed(dist_backend="gloo")` adopts the torch process group; '
        '`UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1, seq_length=N, '
        "seq_length_is_variable=False)` builds its SP groups and replaces transformers' global "
        '`ALL_ATTENTION_FUNCTIONS["sdpa"]` with its wrapper, so the benchmark installs that wrapper only around '
        "DeepSpeed's steps (the no-SP baseline in the same process runs plain sdpa). Its batches are the shards "
        "`UlyssesSPDataLoaderAdapter` makes (labels shifted, then every key sliced), identical to "
        "`ulysses_sp.shard_batch`'s for these lengths.",
        "",
    ]
    if "deepspeed_skipped" in results:
        lines += [f"DeepSpeed: {results['deepspeed_skipped']}.", ""]
    rows, agreement = [], []
    for world, result in results["worlds"].items():
        if result.get("deepspeed_error"):
            lines += [f"DeepSpeed failed to set up at P={world}: `{result['deepspeed_error']}`", ""]
        rows += ratio_rows(world, result)
        agreement += [[world, *row] for row in _agreement_rows(result)]
    lines += md_table(["P", "tokens", "ratio", "median", "min - max", "reps", "median step s (num / den)"], rows)
    lines += [
        "Loss and gradients after one step from identical weights (gradients averaged over the world, fp32). "
        "`rel` = the largest absolute difference of a parameter's gradient divided by that gradient's largest entry.",
        "",
    ]
    lines += md_table(["P", "pair", "loss abs diff", "grad max abs diff", "grad max rel", "params"], agreement)
    lines += [f"![step time]({image})", ""]
    return lines


def _overhead(results: dict[str, Any]) -> list[str]:
    rows = []
    for world, result in results["worlds"].items():
        ratio = result["ratios"]["ulysses-sp / no-sp"]
        rows.append(
            [
                world,
                f"{result['seq_len']:,}",
                f"{result['tokens_per_rank']:,}",
                f"**{ratio['median']:.3f}**",
                f"{ratio['min']:.3f} - {ratio['max']:.3f}",
            ]
        )
    return [
        "## 4. SP overhead against no SP at the same tokens per rank",
        "",
        "Same world, interleaved with section 3: ulysses-sp with sp = P on rows of N tokens against plain "
        "transformers sdpa with dp = P on rows of N / P tokens (each rank computes on N / P tokens either way). "
        "The SP side also does the two all-to-alls per layer and attends over the full N (causal attention over "
        "N tokens for H / P heads costs P times the attention FLOPs of N / P tokens for H heads), so the ratio "
        "includes both.",
        "",
        *md_table(["P", "N", "tokens per rank", "ulysses-sp / no-sp", "min - max"], rows),
    ]


def _gpu(results: dict[str, Any], image: str | None) -> list[str]:
    gpu = results["gpu"]
    lines = ["## 5. GPU mode", ""]
    if "skipped" in gpu:
        return lines + [
            f"Not run: {gpu['skipped']}. Run `ulysses-sp bench` on a CUDA machine to fill this section.",
            "",
        ]
    lines += gpu_table(gpu)
    if image:
        lines += [f"![gpu]({image})", ""]
    return lines


def gpu_table(gpu: dict[str, Any]) -> list[str]:
    """The Markdown lines (a paragraph on the setting, then a table) of one GPU-mode result
    (:func:`ulysses_sp.bench.gpu.run_gpu`)."""
    rows = []
    for name, entry in gpu["models"].items():
        for sp, row in entry["layouts"].items():
            if not row["points"]:
                rows.append([name, sp, "planned max", "0", "the plan fits no sequence", *[""] * 7])
            for point, found in row["points"].items():
                rows.append([name, sp, _POINT_NAMES[point], f"{found['seq_len']:,}", *_gpu_cells(found)])
    from ulysses_sp.plan.units import format_bytes

    lines = [
        f"Device: {gpu['device']}; planned for a GPU of {format_bytes(gpu['gpu_memory_bytes'])} (the allocator capped "
        f"at it) and {format_bytes(gpu['host_memory_bytes'])} of host memory per GPU. Random weights, the features "
        f"`ulysses-sp train` runs on a GPU ({next(iter(gpu['models'].values()))['features']}). One training step "
        "(forward, loss, backward, AdamW) per point as rank 0 of the layout (torch's fake process group for sp > 1): "
        "at the planner's longest sequence, and 10% above it, where the step should not fit; `predicted / measured` "
        "is the planner's error at that point. tokens/s and TFLOPs are the whole sequence's over the measured step "
        "(model FLOPs 6 N + 6 L H d T, recomputation not counted; an sp > 1 rank as if every rank took as long). "
        f"Points estimated to take over {gpu['step_budget_s']:.0f} s a step are skipped.",
        "",
        *md_table(
            [
                "model", "sp", "point", "tokens", "result", "phase", "predicted peak", "measured peak",
                "predicted / measured", "tokens/s", "TFLOPs", "MFU",
            ],
            rows,
        ),
    ]  # fmt: skip
    return lines


_POINT_NAMES = {"throughput": "throughput", "max": "planned max", "over": "planned max + 10%"}


def _gpu_cells(found: dict[str, Any]) -> list[str]:
    """The table cells of one GPU point after its name and length: result, phase, peaks, ratio, speed."""
    if "skipped" in found:
        return [f"skipped: {found['skipped']}", *[""] * 7]
    from ulysses_sp.plan.units import format_bytes

    result = "out of memory" if found["out_of_memory"] else ("fits" if found["fits"] else "over the usable memory")
    cells = [result, found["phase"], format_bytes(found["predicted_peak_bytes"])]
    if found["out_of_memory"]:
        return cells + [""] * 5
    mfu = found.get("mfu")
    return cells + [
        format_bytes(found["measured_peak_bytes"]),
        f"{found['ratio']:.3f}",
        f"{found['tokens_per_s']:,.0f}",
        f"{found['tflops']:.0f}",
        f"{100 * mfu:.1f}%" if mfu else "",
    ]


def render_markdown(results: dict[str, Any], image_dir: str) -> str:
    """The markdown text; images are referenced as ``image_dir/<name>``."""
    plots = {k: f"{image_dir}/{v}" for k, v in results["plots"].items()}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `ulysses-sp bench` (src/ulysses_sp/bench); every number below was measured in the run "
        "described here, and every time is a ratio against a baseline measured in the same run.",
        "",
        *_provenance(results),
        *_memory(results, plots["memory"]),
        *_comm(results, plots["comm"]),
        *_steps(results, plots["steps"]),
        *_overhead(results),
        *_gpu(results, plots.get("gpu")),
        *head_chunks_section(results),
        *tiled_loss_section(results),
    ]
    return "\n".join(lines).rstrip() + "\n"


def write_markdown(results: dict[str, Any], path: Path, out_dir: Path) -> None:
    """Write the report to ``path``, with image links relative to it."""
    image_dir = os.path.relpath(out_dir.resolve(), path.resolve().parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(results, image_dir.replace(os.sep, "/")), encoding="utf-8")
