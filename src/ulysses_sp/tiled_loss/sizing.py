"""How big a tiled-loss chunk is: the budget's unit and the tokens per chunk. Arithmetic only (no torch), so the
flags' defaults, ``--help`` and the planner use it without importing the kernel."""

from __future__ import annotations

__all__ = ["BYTES_PER_LOGIT", "DEFAULT_LOSS_BUDGET_BYTES", "chunk_bytes_per_logit", "loss_chunk_tokens"]

DEFAULT_LOSS_BUDGET_BYTES = 1 << 30
# Bytes per logit a live chunk may hold, forward or backward (the budget's unit): at most the fp32 logits (4)
# and one more tensor of the same shape (see :func:`chunk_bytes_per_logit`). Everything else is in place.
BYTES_PER_LOGIT = 8


def chunk_bytes_per_logit(compute_bytes: int, softcap: bool) -> int:
    """Bytes per logit a live chunk holds at its peak (<= :data:`BYTES_PER_LOGIT`): the fp32 logits, which
    become the softmax and then the gradient in place (4), plus the larger of: the logits and the gradient in
    a 16-bit compute dtype (before their fp32 copy / after their cast: ``compute_bytes`` when < 4) and, with a
    softcap, its slope ``1 - tanh^2`` (4)."""
    return 4 + max(compute_bytes if compute_bytes < 4 else 0, 4 if softcap else 0)


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = DEFAULT_LOSS_BUDGET_BYTES) -> int:
    """Tokens per chunk so that one chunk's logits working set stays within ``budget_bytes``."""
    if vocab_size < 1 or budget_bytes < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and budget_bytes ({budget_bytes}) must be positive")
    return max(1, budget_bytes // (vocab_size * BYTES_PER_LOGIT))
