"""The tiled lm_head + cross-entropy kernel: the causal-LM loss without ever holding ``[tokens, vocab]`` logits.

Tokens are cut into chunks; each chunk's logits are computed, reduced to token losses and dropped. Backward
recomputes each chunk's logits from the saved hidden states and the lm_head weight (one extra lm_head
matmul), writes the chunk's hidden-state gradient into one buffer and adds the weight gradient into one
fp32 accumulator. Exact: the same arithmetic in the same dtypes as ``lm_head`` + ``F.cross_entropy(logits.float())``,
summed in a different order. A live chunk costs :data:`BYTES_PER_LOGIT` bytes per logit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..validation import IGNORE_INDEX

__all__ = ["BYTES_PER_LOGIT", "DEFAULT_LOSS_BUDGET_BYTES", "LogitsHead", "loss_chunk_tokens", "tiled_cross_entropy_sum"]

DEFAULT_LOSS_BUDGET_BYTES = 1 << 30
# Bytes per logit held while a chunk is live, forward or backward: the fp32 logits (4) and one fp32 tensor of
# the same shape (logsumexp's temporary; the softmax that becomes the gradient). Everything else is in place.
BYTES_PER_LOGIT = 8


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = DEFAULT_LOSS_BUDGET_BYTES) -> int:
    """Tokens per chunk so that one chunk's logits working set stays within ``budget_bytes``."""
    if vocab_size < 1 or budget_bytes < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and budget_bytes ({budget_bytes}) must be positive")
    return max(1, budget_bytes // (vocab_size * BYTES_PER_LOGIT))


@dataclass(frozen=True)
class LogitsHead:
    """How hidden states become logits: ``softcap(scale * (h @ W^T + b))`` (softcap: ``c * tanh(x / c)``)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config) -> LogitsHead:
        """The scalings transformers applies after ``lm_head`` for this config (text config of a VLM)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = 1.0
        if getattr(text, "logits_scaling", None):  # Granite: logits / logits_scaling
            scale /= float(text.logits_scaling)
        if getattr(text, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
            scale *= float(text.logit_scale)
        softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3
        return cls(scale=scale, softcap=float(softcap) if softcap else None)

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 raw logits -> fp32 logits."""
        out = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def apply_(self, raw: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` in place on ``raw`` (a temporary the caller owns); returns ``raw``."""
        if self.scale != 1.0:
            raw.mul_(self.scale)
        if self.softcap is not None:
            raw.div_(self.softcap).tanh_().mul_(self.softcap)
        return raw

    def softcap_grad_(self, logits: torch.Tensor) -> torch.Tensor:
        """d softcap(x) / d x at the softcapped ``logits`` (``1 - tanh^2``), written over them; the whole
        d logits / d raw is this times :attr:`scale`. Only with a softcap."""
        assert self.softcap is not None
        return logits.div_(self.softcap).square_().neg_().add_(1.0)


def _chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


def _accumulate_weight_grad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += grad^T @ h`` with a transient no larger than half the chunk's ``grad``.

    acc [V, h] fp32; grad [c, V], h [c, h] in the compute dtype. In fp32 the product goes straight into the
    accumulator. Otherwise it is made in blocks of vocabulary rows, each added to the fp32 accumulator in place
    (the reduction over tokens is the same, so the sums are those of one [V, h] product), so that the
    product never costs a [V, h] tensor in the compute dtype and its fp32 copy (a vocabulary of 152K and a
    hidden size of 2560 would make those 2.3 GB).
    """
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h)
        return
    rows = max(1, grad.numel() // (2 * max(1, h.shape[1])))  # block [rows, h] <= half of grad's elements
    for v0 in range(0, acc.shape[0], rows):
        acc[v0 : v0 + rows] += grad[:, v0 : v0 + rows].t() @ h


class _TiledHeadLoss(torch.autograd.Function):
    """sum over valid tokens of CE(head(hidden @ W^T + b), target); see :func:`tiled_cross_entropy_sum`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, head, ignore_index, compute_dtype):  # type: ignore[override]
        # hidden [T, h]; weight [V, h]; bias [V] or None; targets [T]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start, end in _chunks(hidden.shape[0], chunk):
                logits = head.apply_(F.linear(hidden[start:end].to(compute_dtype), w, b).float())  # [c, V]
                target = targets[start:end]
                valid = target != ignore_index
                picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)  # [c]
                total += torch.where(valid, torch.logsumexp(logits, dim=1) - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk, ctx.head, ctx.ignore_index, ctx.compute_dtype = chunk, head, ignore_index, compute_dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        head, dtype = ctx.head, ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_hidden = torch.empty_like(hidden) if needs_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
            scale = grad_total.float()
            for start, end in _chunks(hidden.shape[0], ctx.chunk):
                h = hidden[start:end].to(dtype)  # [c, h]
                logits = head.apply_(F.linear(h, w, b).float())  # [c, V] fp32
                target = targets[start:end]
                valid = (target != ctx.ignore_index).unsqueeze(1)  # [c, 1]
                grad = torch.softmax(logits, dim=1)  # d CE / d logits = softmax - onehot(target)
                grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
                if head.softcap is not None:
                    grad.mul_(head.softcap_grad_(logits))  # the logits are overwritten
                del logits
                grad = grad.mul_(valid * (scale * head.scale)).to(dtype)  # d loss / d raw [c, V]
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad @ w
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, grad, h)
                if grad_bias is not None:
                    grad_bias += grad.sum(0, dtype=torch.float32)
                del grad  # before the next chunk's logits exist
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def tiled_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    head: LogitsHead | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over valid targets of ``cross_entropy(head(hidden @ weight^T + bias), target)``, in chunks.

    Args:
        hidden: ``[..., h]`` final hidden states (after the model's last norm).
        weight: ``[V, h]`` the output embedding (``lm_head.weight``); ``bias``: ``[V]`` or None.
        targets: ``[...]`` target ids, already shifted (``shift_labels``); ``ignore_index`` = no target.
        head: scaling / soft-capping applied to the logits (default: none).
        chunk_tokens: tokens per chunk (default: :func:`loss_chunk_tokens` for a 1 GiB budget).

    Returns an fp32 scalar. Under autocast the matmuls run in the autocast dtype (as ``lm_head`` would).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; expected hidden "
            "[..., hidden_size] for targets [...]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    chunk = chunk_tokens if chunk_tokens is not None else loss_chunk_tokens(weight.shape[0])
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
    flat_targets = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)  # [T]
    dtype = _compute_dtype(hidden, weight)
    return _TiledHeadLoss.apply(
        flat_hidden, weight, bias, flat_targets, chunk, head or LogitsHead(), ignore_index, dtype
    )
