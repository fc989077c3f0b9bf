"""Right padding keeps a live hidden column: its ids are moved off the embedding's zero padding row.

Every Ulysses core gives a padding query a zero attention output, where one process lets a right pad attend to
the real tokens before it. When the pad's id is also the embedding's ``padding_idx`` (a zero row, as
transformers builds it from ``config.pad_token_id``), the pad's whole hidden column stays exactly zero through
the layers, and a model that takes a root of a column's mean square (Gemma3n's AltUp magnitude
``mean(x**2) ** 0.5``) meets an infinite local derivative there: ``0 x inf = NaN`` in every gradient, where one
process is finite. This holds for the padding :func:`~ulysses_sp.shard_batch` adds for divisibility too.

A right pad feeds no real token (causal attention, and its key is masked) and carries no target, so any other
id gives the real tokens exactly the outputs and gradients they had: the pad's upstream gradient is zero, and
the substitute's embedding row gains an exact zero from it. Left pads are left alone: the last one carries the
first token's target, so its id counts, and one process gives left pads a zero attention output as well.
"""

from __future__ import annotations

import torch

from .cores import Segments
from .layout import ParallelLayout
from .ring import zigzag_order

__all__ = ["lift_padding_ids"]


def _padding_row(model: torch.nn.Module) -> tuple[int, int] | None:
    # (padding_idx, vocabulary size) of the model's input embedding, or None when it has no padding row
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    padding_idx = getattr(embedding, "padding_idx", None)
    rows = getattr(embedding, "num_embeddings", None)
    if padding_idx is None or rows is None or rows < 2:
        return None
    return int(padding_idx) % rows, int(rows)


def _right_padding(segments: Segments, layout: ParallelLayout, local_len: int, device: torch.device) -> torch.Tensor:
    # [b, n] bool: this rank's tokens that come after the last real token of their full row
    full_len = segments.seq_len
    index = torch.arange(full_len, device=device)
    if layout.ring > 1:
        index = zigzag_order(full_len, layout.ring, device)  # shard_batch deals a ring's tokens in zigzag order
    start = layout.sp_rank * local_len if layout.sp > 1 else 0
    local = index[start : start + local_len]  # [n] full-row index of each local token
    last_end = torch.tensor([row[-1][1] if row else full_len for row in segments.spans], device=device)  # [b]
    return local[None, :] >= last_end[:, None]


def lift_padding_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    segments: Segments,
    layout: ParallelLayout,
) -> torch.Tensor | None:
    """``input_ids [b, n]`` (this rank's shard) with each right pad that holds the embedding's ``padding_idx``
    given the id next to it (``padding_idx + 1``, or ``- 1`` at the end of the vocabulary); None when no token
    needs it (then the model runs on ``input_ids`` as given). The caller's tensor is never changed."""
    if input_ids is None or attention_mask is None or attention_mask.dim() != 2:
        return None
    found = _padding_row(model)
    if found is None:
        return None
    padding_idx, rows = found
    at_row = (input_ids == padding_idx) & (attention_mask == 0)
    if not bool(at_row.any()):
        return None
    lift = at_row & _right_padding(segments, layout, input_ids.shape[1], input_ids.device)
    if not bool(lift.any()):
        return None
    other = padding_idx + 1 if padding_idx + 1 < rows else padding_idx - 1
    return input_ids.masked_fill(lift, other)
