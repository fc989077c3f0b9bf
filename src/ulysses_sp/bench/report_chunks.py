"""The bench report's sections of the head-chunked attention (6: step time with 4 chunks over 1) and the tiled loss
(7: against the plain loss)."""

from __future__ import annotations

import statistics
from typing import Any

from .tables import md_table, ratio_rows
from .tiledloss import table_lines

__all__ = ["head_chunks_section", "notes", "tiled_loss_section"]


def _chunk_traffic(result: dict[str, Any]) -> float:
    """All-to-all bytes per layer, 4 chunks over 1 (:func:`ulysses_sp.traffic.ulysses_bytes_per_layer`)."""
    from ulysses_sp.shapes import SHAPES
    from ulysses_sp.traffic import ulysses_bytes_per_layer

    shape = SHAPES[result["model"]]
    heads = dict(heads=shape["num_attention_heads"], kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"])
    sent = [
        ulysses_bytes_per_layer(
            batch=1, seq_len=result["seq_len"], sp=result["world"], element_size=4, chunks=c, **heads
        )
        for c in (4, 1)
    ]
    return sent[0] / sent[1]


def _where_recorded(runs: list[dict[str, Any]], key: str, text: str) -> str:
    """``text`` where some run recorded ``key`` (a results.json of before it was recorded: '')."""
    return text if any(key in run for run in runs) else ""


def _later_run(results: dict[str, Any], key: str) -> list[str]:
    """Where a section was measured apart from the rest of the report (``results[key]`` says how): a line saying so."""
    if key not in results:
        return []
    return [f"This section was measured in a later run than the others: {results[key]}.", ""]


def notes(results: dict[str, Any], section: str) -> list[str]:
    """What was recorded about a section by hand, after its run (``results["notes"][section]``: markdown lines, e.g.
    a GPU lease's findings or earlier runs' ratios), kept in results.json so that ``--report-from`` redraws the whole
    report (a line added to BENCHMARKS.md alone was lost by the next redraw)."""
    return list(results.get("notes", {}).get(section, []))


def _busy(result: dict[str, Any]) -> str:
    """How busy the cores were in a C=1 step of a head-chunk run: its CPU time summed over the ranks, over the
    cores, against its wall time ('' for a run of before the CPU times were recorded)."""
    if "cpu_s" not in result:
        return ""
    cpu, wall = (statistics.median(result[key]["C=1"]) for key in ("cpu_s", "step_times_s"))
    return (
        f"; a C=1 step used {cpu:.2f} CPU s over the {result['world']} ranks on {result['cores']} cores, "
        f"{cpu / result['cores'] / wall:.0%} of the cores for its {wall:.2f} s"
    )


def head_chunks_section(results: dict[str, Any]) -> list[str]:
    if "head_chunks" not in results:  # a results.json from before this section
        return []
    rows, waits = [], []
    # by P, then tokens (keyed "P@tokens"; a results.json of before several lengths is keyed "P")
    for result in sorted(results["head_chunks"].values(), key=lambda r: (r["world"], r["seq_len"])):
        losses = result["losses"]
        rows += ratio_rows(str(result["world"]), result)
        spread = max(losses.values()) - min(losses.values())
        sent = _chunk_traffic(result)
        waits.append(
            f"P={result['world']}, {result['seq_len']:,} tokens: {result['exposed_wait_s']:.3f} s waited in one C=4 "
            f"step; all-to-all bytes per layer C=4 / C=1 {sent:.2f} (`ulysses_sp.traffic`); loss spread {spread:.1e}"
            + _busy(result)
        )
    header = ["P", "tokens", "ratio", "median", "min - max", "reps", "median step s (num / den)"]
    runs = list(results["head_chunks"].values())
    return [
        "## 6. Head-chunked attention: step time with 4 chunks over 1",
        "",
        f"One gloo world per P; `{runs[0]['model']}` (16 heads, 4 kv heads) "
        "parallelized with sp = P from one seed with `head_chunks=1` and `head_chunks=4`, each without and with "
        "activation checkpointing of the decoder layers; train steps interleaved as in section 3, ratio per "
        "repetition, median (min-max), at longer sequences than section 3 (head chunks are for long sequences; "
        "automatic C keeps 1 at short ones; each chunk's fixed costs weigh less as the attention core grows with the "
        "square of the length). With 4 chunks each layer issues 16 all-to-alls, C=1 4 (2 per chunk "
        "forward, 2 backward: the q/k/v again with the output's gradient and the output's row sums, then the q/k/v "
        "gradients), projects q/k/v again in backward and runs the core's fused backward from its saved output's row "
        "sums and lse (no second core forward); a chunk's kv heads would be fewer than the ranks, so the chunks "
        "share them: they are exchanged once per layer as with C=1 (with chunk 0's q, forward and again in "
        "backward; their gradients' sum back with the last chunk's) and each chunk sends its query heads, so C=4 "
        "sends more bytes than C=1 (the "
        "backward's q again and the row sums; the ratio per P below); "
        "chunk c+1's exchange is in flight (gloo's threads) while chunk c's core computes. "
        + _where_recorded(
            runs,
            "compute_alone_s",
            "The rows 'compute alone' time the same four models' steps in one process standing in for rank 0 of P "
            "(a fake process group: each exchange a local copy), on one thread as each rank has: what the chunking "
            "costs in compute (q/k/v projected again in backward, the output projection added chunk by chunk, the "
            "chunks' own code), which the overlap has to pay for. ",
        )
        + _where_recorded(
            runs,
            "cpu_s",
            "The rows 'CPU over the ranks' divide the CPU time of the steps (every rank's, all its threads, gloo's "
            "included), summed over the ranks: where the ranks outnumber the cores (or fill them), no core is free to "
            "run an exchange while another computes, a step takes about that CPU time over the cores, and the "
            "overlap cannot pay; the wall ratio then follows the CPU ratio. ",
        )
        + "The waited time is what rank 0 blocked on those exchanges in one C=4 step (the exchange time not hidden "
        "behind a core); the loss spread is over the four models.",
        "",
        *_later_run(results, "head_chunks_run"),
        *md_table(header, rows),
        *[f"- {line}" for line in waits],
        *notes(results, "head_chunks"),
        "",
    ]


def tiled_loss_section(results: dict[str, Any]) -> list[str]:
    found = results.get("tiled_loss")
    if found is None:  # a results.json from before this section
        return []
    lines = ["## 7. Tiled lm_head + loss against the plain loss", ""]
    if "skipped" in found:
        return [*lines, f"Not run: {found['skipped']}.", ""]
    setup = found["setup"]
    return [
        *lines,
        f"One forward + backward of the lm_head and the cross-entropy over {setup['tokens']:,} tokens (hidden "
        f"{setup['hidden']}, vocabulary {setup['vocab']:,}, {setup['dtype']}, {setup['device']}, {setup['threads']} "
        "threads), as a mean loss: `plain` makes the `[tokens, vocab]` logits and `F.cross_entropy` on them (fp32), "
        "`tiled` is `ulysses_sp.tiled_cross_entropy_sum` (a chunk of tokens at a time, each chunk's gradients made in "
        "the forward, the backward only scales them), `recompute` the same with `recompute=True` (each chunk's "
        "logits made again in backward). The variants are interleaved, "
        f"{setup['rounds']} rounds after one warm-up, each round starting one variant further; the ratio is taken "
        "round by round against that round's plain loss, its median (min-max) shown; cpu = the process's CPU time "
        "(all threads), wall = the clock. Chunks of the library's default size (`loss_chunk_tokens`) and of 512 "
        "tokens.",
        "",
        *_later_run(results, "tiled_loss_run"),
        *table_lines(found["rows"]),
        "",
        *([*notes(results, "tiled_loss"), ""] if notes(results, "tiled_loss") else []),
    ]
