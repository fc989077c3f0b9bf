"""Where the checkpoints live: the planner's choice of activation-checkpointing place and stride.

With ``--activation-checkpointing auto`` on a GPU, ``--checkpoint-stride`` unset and ``--host-memory`` given,
:func:`choose_placement` tries the placements from the least recompute up: every layer's input offloaded to
the host, every layer's on the GPU, then every 2nd layer's (host, then GPU), every 3rd, ... and keeps the first
whose plan fits both the GPU and the host memory. Offloaded inputs cost ``layers / k x tokens x hidden x c``
bytes of host memory per GPU; a stride k holds up to k - 1 recomputed inputs on the GPU during a group's
backward and costs one more forward of k - 1 of every k layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..features import Features
from .units import format_bytes

if TYPE_CHECKING:
    from .memory import MemoryPlan

__all__ = ["choose_placement", "placement_is_chosen", "placements"]


def placement_is_chosen(features: Features, device: str, host_memory_bytes: int) -> bool:
    """True when the planner chooses the checkpoints' place and stride (module docstring)."""
    auto = features.activation_checkpointing == "auto" and features.checkpoint_stride is None
    return auto and device == "cuda" and host_memory_bytes > 0


def placements(features: Features, layers: int) -> list[Features]:
    """The candidate placements in order of recompute: (host, 1), (GPU, 1), (host, 2), (GPU, 2), ..."""
    return [
        dataclasses.replace(features, activation_checkpointing=mode, checkpoint_stride=stride)
        for stride in range(1, max(1, layers) + 1)
        for mode in ("offload", "checkpoint")
    ]


def _describe(plan: MemoryPlan) -> str:
    features = plan.features
    where = "host memory" if features.activation_checkpointing == "offload" else "the GPU"
    stride = features.checkpoint_stride
    every = "every layer's input" if stride == 1 else f"1 in {stride} layer inputs (the others recomputed)"
    host = f"{format_bytes(plan.host_bytes_per_node)} of {format_bytes(plan.host_memory_bytes)} host memory per node"
    return f"{every} on {where} ({host}, {format_bytes(plan.peak_bytes)} of {format_bytes(plan.usable_bytes)} per GPU)"


def choose_placement(features: Features, layers: int, plan: Callable[..., MemoryPlan]) -> MemoryPlan:
    """The plan of the first placement that fits (``plan(features=...)`` builds one); when none does, the
    default's (every layer's input on the host), saying so."""
    for candidate in placements(features, layers):
        chosen = plan(features=candidate)
        if chosen.fits:
            chosen.checkpoint_choice = f"{_describe(chosen)}: the least recompute that fits both memories"
            return chosen
    default = plan(features=placements(features, layers)[0])
    default.checkpoint_choice = f"{_describe(default)}: no placement fits both memories"
    return default
