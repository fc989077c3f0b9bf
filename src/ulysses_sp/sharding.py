"""Full batch -> this rank's sequence shard, and back.

:func:`shard_batch` pads the sequence to a multiple of ``sp`` (never dropping a token), shifts the labels
BEFORE slicing (so the last token of a shard keeps its target, the first token of the next shard), builds
global position_ids, and slices tokens ``[sp_rank * n, (sp_rank + 1) * n)`` of every row.

With a ring (``layout.ring > 1``) the rows are first put in zigzag order (:func:`ulysses_sp.ring.zigzag_order`,
padded to a multiple of ``lcm(sp, 2 * ring)``) so that causal attention costs every ring rank the same;
every per-token key moves with its token, so the loss (a sum over tokens) is unchanged.

:func:`gather_sequence` puts the shards of a per-token tensor back together, in sequence order (for metrics).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .batch_checks import SHARDED_KEYS, batch_check, checked_pad_id, compare_in_group, shift_labels, validated
from .layout import ParallelLayout
from .ring import from_zigzag, zigzag_order
from .validation import IGNORE_INDEX, cut_of, gather_cut_problem, mark_cut, peers_join, replicas_agree

__all__ = [
    "IGNORE_INDEX",
    "gather_sequence",
    "pad_to_multiple",
    "shard_batch",
    "shift_labels",
]


def pad_to_multiple(x: torch.Tensor, multiple: int, value: int | float) -> torch.Tensor:
    """Right-pad dim 1 of ``x`` to a multiple of ``multiple`` with ``value``."""
    extra = (-x.shape[1]) % multiple
    if extra == 0:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def shard_batch(
    batch: Mapping[str, object],
    layout: ParallelLayout,
    *,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    check_same_batch: bool = True,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Turn a full batch into this rank's shard.

    Args:
        batch: ``input_ids [b, N]`` (or ``inputs_embeds [b, N, hidden]``: embedded tokens, e.g. with a soft prompt
            or another tower's tokens merged in); optional ``labels [b, N]`` (unshifted, as for a HF causal LM),
            ``attention_mask [b, N]`` (1 = token, 0 = padding), ``position_ids [b or 1, N]`` (restarting at 0
            for each packed document), ``shift_labels [b, N]`` (targets already shifted: they win over
            ``labels``, as in transformers' loss). Other keys are passed through untouched.
        layout: the parallel layout; ``layout.sp`` ranks split the sequence.
        pad_token_id: id used to pad ``input_ids`` up to a multiple of ``sp`` (``inputs_embeds``: zeros); checked at
            every call (a ValueError unless an int in ``[0, vocab_size)``, or non-negative without ``vocab_size``).
        ignore_index: the label that means "no loss here" in ``batch`` (default -100). The shard's ``labels`` and
            ``shift_labels`` always use -100, the value the loss functions (and transformers') ignore.
        check_same_batch: compare a fingerprint (a hash of the values) of every per-token tensor of the full
            batch (input_ids, labels, attention_mask, position_ids, shift_labels) across the SP group (one
            all-gather of 20 integers) and raise ValueError on every rank if the ranks hold different batches
            — the usual sign of a data sampler split over the whole world instead of over ``layout.dp`` — or
            if any rank's batch is malformed (so a bad batch on one rank never leaves the others waiting).
            With ``dp > 1`` the verdict is then shared with the other data-parallel replicas (one flag
            all-reduce over the world, ``sp == 1`` included), so a batch refused on one replica raises on every
            rank. The comparison is skipped under ``sp == 1`` (no other rank holds the batch), and everything for
            a :meth:`~ulysses_sp.ParallelLayout.rank_view` (no group); one process runs no collective.
        vocab_size: when given, input_ids and labels outside ``[0, vocab_size)`` (labels may also be
            ``ignore_index``) raise a ValueError naming the id, on every rank of the group; without it
            only negative ids are caught. Pass ``model.config.vocab_size``.

    Returns a dict with ``input_ids`` (or ``inputs_embeds``), ``position_ids`` (global positions) and, when given
    or when padding was added, ``attention_mask`` of shape ``[b, n]`` with ``n = ceil(N / sp)``; with labels, also
    ``shift_labels`` ``[b, n]`` (targets, shifted before slicing) and ``labels`` (the local slice, so
    transformers models still return a loss when given ``shift_labels``). The padding added for divisibility
    sits at the end of each row, masked, with positions restarting at 0 and ignored labels, so it changes
    nothing for the real tokens of a causal model (nor for statistics over them, such as the MoE
    load-balancing loss). With ``layout.ring > 1`` the row is padded to a multiple of
    ``lcm(sp, 2 * ring)`` and dealt in zigzag order (see the module docstring).
    """
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"batch must be a dict of [batch, seq_len] tensors (input_ids, ...), got {type(batch).__name__}"
        )
    if not isinstance(layout, ParallelLayout):
        raise ValueError(f"layout must be a ulysses_sp.ParallelLayout, got {type(layout).__name__}")
    pad_token_id = checked_pad_id(pad_token_id, vocab_size)
    # with dp > 1, a refusal on one replica stops them all
    with replicas_agree(layout) if check_same_batch else contextlib.nullcontext():
        full, problem = validated(batch, vocab_size, ignore_index)
        if check_same_batch and layout.sp > 1 and not layout.is_view:
            # raises on every rank if any rank has a problem
            compare_in_group(batch_check(full, problem, vocab_size, ignore_index), layout)
        elif problem is not None:
            raise ValueError(problem.message)
    labels, mask, positions = (full.get(k) for k in ("labels", "attention_mask", "position_ids"))
    given_targets = full.get("shift_labels")  # already shifted by the caller: they win, as in transformers' loss
    tokens_key = "input_ids" if "input_ids" in full else "inputs_embeds"
    tokens = full[tokens_key]  # input_ids [b, N] or inputs_embeds [b, N, hidden]
    b, seq_len = tokens.shape[:2]
    sp = layout.sp
    if positions is None:
        positions = torch.arange(seq_len, device=tokens.device).unsqueeze(0)
    positions = positions.expand(b, seq_len).to(torch.long)

    ring = layout.ring
    multiple = sp if ring == 1 else math.lcm(sp, 2 * ring)
    extra = (-seq_len) % multiple
    if extra:
        # The padding is a document of its own (positions 0, 1, ...): it never raises the largest position,
        # which length-dependent RoPE (dynamic, longrope) reads, and no real token attends to it.
        tail = torch.arange(extra, device=positions.device).expand(b, extra)
        positions = torch.cat([positions, tail], dim=1)
        tokens = pad_to_multiple(tokens, multiple, pad_token_id if tokens_key == "input_ids" else 0.0)
        # ... and it is padding: masked (a mask is made when the batch has none), so no statistic over the
        # tokens (the MoE load-balancing loss) counts it
        mask = pad_to_multiple(mask if mask is not None else positions.new_ones(b, seq_len), multiple, 0)
    n = (seq_len + extra) // sp
    order = zigzag_order(seq_len + extra, ring, tokens.device) if ring > 1 else None

    def local(x: torch.Tensor) -> torch.Tensor:  # [b, N, ...] -> this rank's [b, n, ...]
        if order is not None:
            x = x.index_select(1, order)
        return x[:, layout.sp_rank * n : (layout.sp_rank + 1) * n].contiguous()

    out: dict[str, torch.Tensor] = {k: v for k, v in batch.items() if k not in SHARDED_KEYS}  # type: ignore[misc]
    out[tokens_key] = local(tokens)
    out["position_ids"] = local(positions)
    if mask is not None:
        out["attention_mask"] = local(mask)
    if labels is not None:
        out["labels"] = local(pad_to_multiple(labels, multiple, IGNORE_INDEX))
    if given_targets is None and labels is not None:
        given_targets = shift_labels(labels)
    if given_targets is not None:
        out["shift_labels"] = local(pad_to_multiple(given_targets, multiple, IGNORE_INDEX))
    for key in SHARDED_KEYS:  # the cut, for the model's cut_problem and gather_sequence's gather_cut_problem
        if key in out:
            mark_cut(out[key], cut_of(layout))
    return out


def gather_sequence(x: torch.Tensor, layout: ParallelLayout, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard of it: the inverse of :func:`shard_batch`'s cut, for metrics.

    ``x`` is this rank's shard ``[..., n, ...]`` along ``dim`` (a tensor of :func:`shard_batch`'s output, or a
    model output computed from one, such as logits ``[b, n, vocab]`` or their argmax ``[b, n]``). Returns
    ``[..., sp * n, ...]`` in sequence order on every rank of the SP group (the zigzag order of ``ring > 1``
    undone), with the padding that :func:`shard_batch` added for divisibility still at the end of each row (its
    ``shift_labels`` are -100 there): cut the rows back to the batch's length where it matters. A collective over
    the SP group: every rank of it must call it. Not differentiable: call it under ``torch.no_grad()`` or on a
    detached tensor. Raises ValueError on every rank of the group when any rank's shard is not one (no sequence
    ``dim``, needs a gradient), the shards differ in shape or dtype, or a shard carries the mark of a cut for another
    layout (another ``sp`` or ``ring``: the tensors of :func:`shard_batch`'s output, and a parallelized model's
    ``logits`` and ``hidden_states`` on them, carry it; a tensor computed from one, such as an argmax, does not).
    """
    if not isinstance(layout, ParallelLayout):
        raise ValueError(f"layout must be a ulysses_sp.ParallelLayout, got {type(layout).__name__}")
    problem = _not_a_shard(x, dim) or gather_cut_problem(x, layout)
    if layout.sp == 1 or problem is not None and layout.is_view:
        if problem is not None:
            raise ValueError(problem)
        return x
    if layout.is_view:
        raise ValueError("a ParallelLayout.rank_view has no process group to gather over; use ParallelLayout.from_env")
    mine = (problem, None) if problem is not None else (None, (tuple(x.shape), str(x.dtype), dim % x.dim()))
    metas: list = [None] * layout.sp
    with peers_join("gathering a tensor's shards (gather_sequence)"):
        dist.all_gather_object(metas, mine, group=layout.sp_group)  # every rank's verdict: all raise, or none
    bad = [(r, why) for r, (why, _) in enumerate(metas) if why is not None]
    if bad:
        raise ValueError(problem if problem is not None else f"sp_rank {bad[0][0]} of the SP group: {bad[0][1]}")
    if any(meta[1] != metas[0][1] for meta in metas):
        shards = ", ".join(f"sp_rank {r}: {shape} {dtype} dim {d}" for r, (_, (shape, dtype, d)) in enumerate(metas))
        raise ValueError(f"gather_sequence needs the same shard shape, dtype and dim on every rank, got {shards}")
    dim %= x.dim()
    send = x.detach().contiguous()
    send = send.view(torch.uint8) if send.dtype == torch.bool else send  # gloo has no bool
    parts = [torch.empty_like(send) for _ in range(layout.sp)]
    dist.all_gather(parts, send, group=layout.sp_group)
    # [..., sp * n, ...] in sp_rank order; shard_batch dealt a ring's tokens in zigzag order: back to sequence order
    full = from_zigzag(torch.cat(parts, dim=dim), layout.ring, dim)
    return full.view(torch.bool) if x.dtype == torch.bool else full


def _not_a_shard(x: object, dim: object) -> str | None:
    """Why ``x`` cannot be gathered along ``dim`` (None when it can)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        described = "a 0-dim tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        return f"gather_sequence needs a tensor with a sequence dim, got {described}"
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        return f"dim={dim!r} is not a dim of a tensor of shape {tuple(x.shape)}"
    if x.requires_grad and torch.is_grad_enabled():
        return (
            "gather_sequence is not differentiable: call it under torch.no_grad() or on x.detach() (for a loss over "
            "the whole sequence use causal_lm_loss / sequence_parallel_cross_entropy on the shards)"
        )
    return None
