"""Full batch -> this rank's sequence shard, and back.

:func:`shard_batch` pads the sequence to a multiple of ``sp`` (never dropping a token), shifts the labels
BEFORE slicing (so the last token of a shard keeps its target, the first token of the next shard), builds
global position_ids, and slices tokens ``[sp_rank * n, (sp_rank + 1) * n)`` of every row.

With a ring (``layout.ring > 1``) the rows are first put in zigzag order (:func:`ulysses_sp.ring.zigzag_order`,
padded to a multiple of ``lcm(sp, 2 * ring)``) so that causal attention costs every ring rank the same;
every per-token key moves with its token, so the loss (a sum over tokens) is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .comm import all_gather_tensor
from .layout import ParallelLayout
from .ring import zigzag_order

__all__ = ["IGNORE_INDEX", "SHARDED_KEYS", "pad_to_multiple", "shard_batch", "shift_labels"]

IGNORE_INDEX = -100
# The per-token keys shard_batch slices over the sequence; any other key passes through untouched.
SHARDED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[b, N]`` labels -> ``[b, N]`` targets: position t gets ``labels[t + 1]``; the last gets ignore_index."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index).contiguous()


def pad_to_multiple(x: torch.Tensor, multiple: int, value: int | float) -> torch.Tensor:
    """Right-pad dim 1 of ``x`` to a multiple of ``multiple`` with ``value``."""
    extra = (-x.shape[1]) % multiple
    if extra == 0:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def _as_2d(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq_len], got shape {tuple(value.shape)}")
    return value


def shard_batch(
    batch: Mapping[str, object],
    layout: ParallelLayout,
    *,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    check_same_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """Turn a full batch into this rank's shard.

    Args:
        batch: ``input_ids [b, N]``; optional ``labels [b, N]`` (unshifted, as for a HF causal LM),
            ``attention_mask [b, N]`` (1 = token, 0 = padding), ``position_ids [b or 1, N]`` (restarting at 0
            for each packed document). Other keys are passed through untouched.
        layout: the parallel layout; ``layout.sp`` ranks split the sequence.
        pad_token_id: id used to pad ``input_ids`` up to a multiple of ``sp``.
        check_same_batch: compare a fingerprint of the full batch across the SP group (one all-gather of
            4 integers) and raise ValueError on every rank if the ranks hold different batches — the usual
            sign of a data sampler split over the whole world instead of over ``layout.dp``.

    Returns a dict with ``input_ids``, ``position_ids`` (global positions) and, when given,
    ``attention_mask`` of shape ``[b, n]`` with ``n = ceil(N / sp)``; with labels, also ``shift_labels``
    ``[b, n]`` (targets, shifted before slicing) and ``labels`` (the local slice, so transformers models
    still return a loss when given ``shift_labels``). The padding added for divisibility sits at the end
    of each row, with ignored labels and positions that continue the row, so it changes nothing for the
    real tokens of a causal model. With ``layout.ring > 1`` the row is padded to a multiple of
    ``lcm(sp, 2 * ring)`` and dealt in zigzag order (see the module docstring).
    """
    if "input_ids" not in batch:
        raise ValueError(f"the batch needs input_ids; it has keys {sorted(batch)}")
    input_ids = _as_2d("input_ids", batch["input_ids"])
    b, seq_len = input_ids.shape
    sp = layout.sp

    def check(name: str) -> torch.Tensor | None:
        value = batch.get(name)
        if value is None:
            return None
        value = _as_2d(name, value).to(input_ids.device)
        if (
            value.shape[1] != seq_len
            or value.shape[0] not in (b, 1)
            or (name != "position_ids" and value.shape[0] != b)
        ):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but input_ids has shape {tuple(input_ids.shape)}; "
                f"they must match (labels are the unshifted input ids, -100 where no loss is wanted)"
            )
        return value

    labels, mask, positions = check("labels"), check("attention_mask"), check("position_ids")
    given_targets = check("shift_labels") if labels is None else None  # already shifted by the caller
    if check_same_batch and layout.sp > 1:
        _check_same_batch(input_ids, layout)
    if positions is None:
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    positions = positions.expand(b, seq_len).to(torch.long)

    ring = getattr(layout, "ring", 1)
    multiple = sp if ring == 1 else math.lcm(sp, 2 * ring)
    extra = (-seq_len) % multiple
    if extra:
        tail = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
        positions = torch.cat([positions, tail], dim=1)
        input_ids = pad_to_multiple(input_ids, multiple, pad_token_id)
        if mask is not None:
            mask = pad_to_multiple(mask, multiple, 0)
    n = (seq_len + extra) // sp
    order = zigzag_order(seq_len + extra, ring, input_ids.device) if ring > 1 else None

    def local(x: torch.Tensor) -> torch.Tensor:  # [b, N] -> this rank's [b, n]
        if order is not None:
            x = x.index_select(1, order)
        return x[:, layout.sp_rank * n : (layout.sp_rank + 1) * n].contiguous()

    out: dict[str, torch.Tensor] = {k: v for k, v in batch.items() if k not in SHARDED_KEYS}  # type: ignore[misc]
    out["input_ids"] = local(input_ids)
    out["position_ids"] = local(positions)
    if mask is not None:
        out["attention_mask"] = local(mask)
    if labels is not None:
        out["shift_labels"] = local(pad_to_multiple(shift_labels(labels, ignore_index), multiple, ignore_index))
        out["labels"] = local(pad_to_multiple(labels, multiple, ignore_index))
    elif given_targets is not None:
        out["shift_labels"] = local(pad_to_multiple(given_targets, multiple, ignore_index))
    return out


def _check_same_batch(input_ids: torch.Tensor, layout: ParallelLayout) -> None:
    # [batch, seq, weighted sum, plain sum] of the full batch, compared across the SP group.
    ids = input_ids.reshape(-1).to(torch.long)
    weights = torch.arange(ids.numel(), device=ids.device) % 65521 + 1
    mine = torch.stack(
        [
            torch.tensor(input_ids.shape[0]),
            torch.tensor(input_ids.shape[1]),
            (ids * weights).sum().cpu(),
            ids.sum().cpu(),
        ]
    )
    prints = all_gather_tensor(mine.to(layout.device), layout.sp_group).tolist()
    if any(p != prints[0] for p in prints):
        raise ValueError(
            f"the ranks of sequence-parallel group {layout.dp_rank} hold different batches (batch/seq/fingerprint "
            f"per sp_rank: {prints}); every rank of an SP group must get the SAME full batch: split your data "
            f"over the {layout.dp} data-parallel groups (e.g. DistributedSampler(num_replicas=layout.dp, "
            "rank=layout.dp_rank)), not over all ranks"
        )
