"""Where a parallelized model leaves ``torch.compile``'s graph on purpose, and the reason dynamo then shows.

Once per forward pass ulysses_sp checks the shard across the SP group (small host-side collectives, values read
on the host) and works out its documents, and in training it sets each rank's dropout seed: Python that
depends on data, which runs eagerly around the compiled code (one graph break each, instead of dynamo failing
on it frame after frame). With ``fullgraph=True`` over the whole model these are the breaks dynamo reports,
with :data:`FULLGRAPH_HINT`: the decoder layers, compiled one by one, trace whole. Inside a layer, what runs
eagerly is what a graph could not hold from batch to batch: attention over packed documents or padding (per
document, by spans that change with every batch), heads in chunks, and a tiled MoE block whose router logits are
recorded. The tiled MLP and norms themselves are operators of the graph (:mod:`ulysses_sp.tiled_op`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["FULLGRAPH_HINT", "TILED_OFF", "run_eagerly"]

F = TypeVar("F", bound=Callable[..., Any])

FULLGRAPH_HINT = (
    "a parallelized model's forward cannot be one graph (torch.compile fullgraph=True); compile its decoder layers "
    "instead: for layer in model.model.layers: layer.compile(fullgraph=True)"
)

TILED_OFF = (
    "to compile the decoder layers whole (fullgraph=True), turn the tiled MLP and norms off: "
    "Features(tiled_mlp=False, tiled_norms=False) (--no-tiled-mlp --no-tiled-norms)"
)


def run_eagerly(why: str, fix: str = FULLGRAPH_HINT) -> Callable[[F], F]:
    """``torch.compiler.disable`` whose reason (where this torch takes one) says ``why`` and, for fullgraph=True,
    ``fix``."""
    if "reason" not in inspect.signature(torch.compiler.disable).parameters:  # torch < 2.8
        return torch.compiler.disable
    return lambda fn: torch.compiler.disable(fn, reason=f"ulysses_sp {why}; {fix}")
