"""Markdown pieces shared by the bench report's sections and the benchmark scripts: tables, ratio rows, and a
script's saved table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["md_table", "ratio_rows", "ratio_summary", "save_table"]


def md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def ratio_rows(world: str, result: dict[str, Any]) -> list[list[Any]]:
    """One table row per step-time ratio of a world: P, tokens, name, median, min - max, reps, median times."""
    return [
        [
            world,
            f"{result['seq_len']:,}",
            name,
            f"**{ratio['median']:.3f}**",
            f"{ratio['min']:.3f} - {ratio['max']:.3f}",
            ratio["reps"],
            f"{ratio['median_time_s']:.3f} / {ratio['baseline_median_time_s']:.3f}",
        ]
        for name, ratio in result["ratios"].items()
    ]


def save_table(directory: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """A benchmark script's output: ``result`` as ``name.json`` and its table as ``name.md`` under ``directory``
    (made if missing), and the table printed."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (directory / f"{name}.md").write_text(markdown)
    print(markdown)


def ratio_summary(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Per-repetition ratios (the two were measured back to back), summarised."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator, strict=True))
    return {
        "median": statistics.median(ratios),
        "min": ratios[0],
        "max": ratios[-1],
        "reps": len(ratios),
        "median_time_s": statistics.median(numerator),
        "baseline_median_time_s": statistics.median(denominator),
    }
