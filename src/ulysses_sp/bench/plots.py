"""PNG plots of a benchmark run (matplotlib, the ``bench`` extra): small files for BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]

_DPI = 90


def _figure(panels: int, width: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, 3.2), dpi=_DPI)
    return plt, fig, (axes if panels > 1 else [axes])


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path.name


def _memory(results: dict[str, Any], path: Path) -> str:
    plt, fig, axes = _figure(2)
    rows = results["memory"]
    for ax, key, title in zip(axes, ("saved_bytes", "peak_bytes"), ("saved activations", "peak (step)"), strict=True):
        for sp in sorted({r["sp"] for r in rows}):
            points = sorted((r["seq_len"], r[key] / 2**20) for r in rows if r["sp"] == sp)
            ax.plot(*zip(*points, strict=True), marker="o", label=f"sp={sp}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("MiB per rank")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _comm(results: dict[str, Any], path: Path) -> str:
    plt, fig, axes = _figure(2)
    rows = [r for r in results["comm"] if r["implementation"] != "ulysses formula"]
    names = sorted(
        {r["implementation"] for r in rows}, key=["ulysses-sp", "deepspeed", "ulysses-sp ring", "ring attention"].index
    )
    sps = sorted({r["sp"] for r in rows})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(sps))]
        by_sp = {r["sp"]: r for r in rows if r["implementation"] == name}
        sent = [
            (by_sp[s].get("all_to_all_bytes_per_layer", 0) + by_sp[s].get("p2p_bytes_per_layer", 0)) / 2**20
            if s in by_sp
            else 0
            for s in sps
        ]
        calls = [
            by_sp[s].get("all_to_all_per_layer", 0) + by_sp[s].get("p2p_sends_per_layer", 0) if s in by_sp else 0
            for s in sps
        ]
        axes[0].bar(xs, sent, width, label=name + (" (formula)" if name == "ring attention" else ""))
        axes[1].bar(xs, calls, width, label=name)
    for ax, label in zip(axes, ("MiB sent per layer (fwd+bwd)", "collectives / p2p sends per layer"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sps))], [f"P={s}" for s in sps])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def _steps(results: dict[str, Any], path: Path) -> str:
    plt, fig, axes = _figure(1, width=6.5)
    ax = axes[0]
    labels, medians, lows, highs = [], [], [], []
    for world, result in results["worlds"].items():
        for name, ratio in result["ratios"].items():
            labels.append(name.replace(" / ", "\n/ ") + f"\nP={world}")
            medians.append(ratio["median"])
            lows.append(ratio["median"] - ratio["min"])
            highs.append(ratio["max"] - ratio["median"])
    ax.bar(range(len(labels)), medians, yerr=[lows, highs], capsize=4, color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("step-time ratio (median, min-max)")
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def _gpu(results: dict[str, Any], path: Path) -> str:
    plt, fig, axes = _figure(1)
    ax = axes[0]
    labels, ratios = [], []
    for name, entry in results["gpu"]["models"].items():
        for sp, row in entry["layouts"].items():
            for point, found in row["points"].items():
                if found.get("ratio"):
                    labels.append(f"{name}\nsp={sp} {point}")
                    ratios.append(found["ratio"])
    ax.bar(range(len(ratios)), ratios)
    ax.axhspan(0.9, 1.1, alpha=0.15, label="within 10%")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("planner: predicted / measured peak")
    ax.set_title(results["gpu"]["device"])
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def write_plots(results: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write the PNGs of ``results`` into ``out_dir``; returns ``{section: file name}``."""
    plots = {
        "memory": _memory(results, out_dir / "memory.png"),
        "comm": _comm(results, out_dir / "comm.png"),
        "steps": _steps(results, out_dir / "steptime.png"),
    }
    if "models" in results.get("gpu", {}):
        plots["gpu"] = _gpu(results, out_dir / "gpu.png")
    return plots
