"""Tiled lm_head + cross-entropy: the kernel (:mod:`.kernel`), the causal-LM forward that uses it (:mod:`.patch`)
and the chunk sizing (:mod:`.sizing`, no torch).

Names are imported from their module on first use (PEP 562), as in the top package: the flags' defaults and the
planner need only :mod:`.sizing`, so ``--help`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kernel import LogitsHead, tiled_cross_entropy_sum
    from .patch import (
        LABEL_SMOOTHING,
        ROUTER_LOGITS_TO_CALLER,
        disable_tiled_loss,
        enable_tiled_loss,
        tiled_loss_enabled,
    )
    from .sizing import BYTES_PER_LOGIT, DEFAULT_LOSS_BUDGET_BYTES, chunk_bytes_per_logit, loss_chunk_tokens

_EXPORTS = {
    ".kernel": ("LogitsHead", "tiled_cross_entropy_sum"),
    ".patch": (
        "LABEL_SMOOTHING",
        "ROUTER_LOGITS_TO_CALLER",
        "disable_tiled_loss",
        "enable_tiled_loss",
        "tiled_loss_enabled",
    ),
    ".sizing": ("BYTES_PER_LOGIT", "DEFAULT_LOSS_BUDGET_BYTES", "chunk_bytes_per_logit", "loss_chunk_tokens"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "BYTES_PER_LOGIT",
    "DEFAULT_LOSS_BUDGET_BYTES",
    "LABEL_SMOOTHING",
    "ROUTER_LOGITS_TO_CALLER",
    "LogitsHead",
    "chunk_bytes_per_logit",
    "disable_tiled_loss",
    "enable_tiled_loss",
    "loss_chunk_tokens",
    "tiled_cross_entropy_sum",
    "tiled_loss_enabled",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept in this namespace)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
