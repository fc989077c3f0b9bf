"""Tiled lm_head + cross-entropy: the kernel (:mod:`.kernel`), the causal-LM forward that uses it (:mod:`.patch`)
and the chunk sizing (:mod:`.sizing`, no torch).

Names are imported from their module on first use (PEP 562), as in the top package: the flags' defaults and the
planner need only :mod:`.sizing`, so ``--help`` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

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


_HOME, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
