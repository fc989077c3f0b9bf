"""The benchmarks' models: a named shape of :data:`ulysses_sp.shapes.SHAPES` with seeded random weights (every
section and every rank builds its models here)."""

from __future__ import annotations

from typing import Any

__all__ = ["bench_model"]


def bench_model(name: str, max_positions: int, seed: int = 0) -> Any:
    """The benchmark model ``name`` (a shape of :data:`ulysses_sp.shapes.SHAPES`) with seeded random weights."""
    from ulysses_sp.shapes import random_model, shape_config

    config = shape_config(name, max_position_embeddings=max(max_positions, 2048), use_cache=False)
    return random_model(config, seed=seed)
