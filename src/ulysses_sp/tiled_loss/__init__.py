"""Tiled lm_head + cross-entropy: the kernel (:mod:`.kernel`) and the causal-LM forward that uses it (:mod:`.patch`)."""

from .kernel import (
    BYTES_PER_LOGIT,
    DEFAULT_LOSS_BUDGET_BYTES,
    LogitsHead,
    chunk_bytes_per_logit,
    loss_chunk_tokens,
    tiled_cross_entropy_sum,
)
from .patch import LABEL_SMOOTHING, ROUTER_LOGITS_TO_CALLER, disable_tiled_loss, enable_tiled_loss, tiled_loss_enabled

__all__ = [
    "BYTES_PER_LOGIT",
    "DEFAULT_LOSS_BUDGET_BYTES",
    "LABEL_SMOOTHING",
    "LogitsHead",
    "chunk_bytes_per_logit",
    "ROUTER_LOGITS_TO_CALLER",
    "disable_tiled_loss",
    "enable_tiled_loss",
    "loss_chunk_tokens",
    "tiled_cross_entropy_sum",
    "tiled_loss_enabled",
]
