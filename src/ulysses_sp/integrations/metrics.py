"""``accelerator.gather_for_metrics`` for sequence shards: every sample of the step once, whole sequences.

Accelerate gathers from every rank and, at the end of a dataloader, keeps the first ``remainder`` rows. Under
sequence parallelism the ``sp`` ranks of a group hold the same samples (each a different part of every
sequence), so its gather returns each group's batch ``sp`` times, and its cut keeps rows that are not the groups'
samples. :func:`gather_for_metrics` gathers each sequence from its SP group (:func:`~ulysses_sp.gather_sequence`),
then the groups' samples over the ``dp`` groups in their order, and applies Accelerate's cut to those, as plain
data parallelism over ``dp`` processes would.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch_checks import SHARDED_KEYS, tensor_digest
from ..layout import ParallelLayout
from ..sharding import gather_sequence
from ..validation import IGNORE_INDEX, replicas_agree

__all__ = [
    "drop_repeats",
    "gather_for_metrics",
    "gather_objects",
    "gather_over_dp",
    "only_logits",
    "repeated_rows",
    "sequence_parallel_gather",
    "whole_eval_batch",
    "without_repeats",
]


def gather_for_metrics(
    accelerator: Any,
    input_data: Any,
    layout: ParallelLayout,
    *,
    sequence_dim: int | None = None,
    pad_index: int | float = -100,
) -> Any:
    """Gather ``input_data`` (tensors, nested in tuples, lists or dicts) for a metric: one row per sample of the
    global batch, on every rank. A collective: every rank calls it with the same structure.

    Args:
        accelerator: the ``Accelerator`` whose prepared dataloader the batch came from (its end-of-dataloader
            state says how many rows of the last, evened-out batch are real samples).
        input_data: with ``sequence_dim`` None, per-sample tensors ``[b, ...]`` that every rank of an SP group
            holds alike (ids, labels of a sample, values reduced over the group: ValueError if they differ); with
            ``sequence_dim=1``, per-token tensors of this rank's shard ``[b, n, ...]`` (the batch's
            ``shift_labels``, predictions from the shard's logits), returned as whole sequences ``[B, N, ...]``
            with the divisibility padding at the end of each row (``shift_labels`` -100 there).
        layout: the layout the model was parallelized with (``SequenceParallelLoss.layout``).
        sequence_dim: the sequence dim of every tensor of ``input_data``, or None for per-sample tensors.
        pad_index: fills the end of shorter rows where the dp groups' batches were padded to different lengths
            (bool tensors: False).

    Tensors that need a gradient are detached (metrics need none). A refusal on any rank (a per-sample tensor that
    differs inside an SP group, shards that are not alike) raises a ValueError on every rank, never a hang.
    """
    from accelerate.utils import recursively_apply

    try:
        recursively_apply(lambda t: t, input_data, error_on_other_type=True)
    except TypeError as error:
        raise ValueError(
            "gather_for_metrics under SP gathers tensors (in tuples, lists or dicts); reduce other values over "
            f"layout.loss_group first ({error})"
        ) from None
    with replicas_agree(layout):  # a refusal inside one SP group stops every group before the dp gather below
        if sequence_dim is not None:
            data = recursively_apply(lambda t: gather_sequence(t.detach(), layout, sequence_dim), input_data)
        else:
            data = recursively_apply(lambda t: _same_in_group(t.detach(), layout), input_data)
    return drop_repeats(accelerator, gather_over_dp(data, layout, pad_index))


def sequence_parallel_gather(accelerator: Any, layout: ParallelLayout) -> Any:
    """A stand-in for ``accelerator.gather_for_metrics`` under SP (installed by the integrations), for code that calls
    Accelerate's own (TRL's metrics, a user's eval loop): Accelerate's would take each SP group's batch for ``sp``
    batches and each shard for a sample.

    A scalar (a shard's part of a sum: TRL's token counts) comes from every rank, as ``accelerator.gather`` gives it;
    per-sample tensors alike on an SP group are gathered over the dp groups, every sample once
    (:func:`gather_for_metrics`); per-token tensors of the shards, which differ inside a group, are refused with a
    ValueError on every rank naming ``loss_fn.gather_for_metrics(..., sequence_dim=1)``. Python objects (a list of
    each sample's strings; ``use_gather_object=True``, or data that is not all tensors, as Accelerate decides) are
    gathered as Accelerate gathers them, once per dp group (:func:`gather_objects`)."""
    from accelerate.utils import recursively_apply

    def gather(input_data: Any, use_gather_object: bool = False) -> Any:
        try:
            recursively_apply(lambda t: t, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True  # as Accelerate's: objects are gathered as objects
        if use_gather_object:
            return gather_objects(accelerator, input_data, layout)
        if isinstance(input_data, torch.Tensor) and input_data.dim() == 0:
            return accelerator.gather(input_data)
        try:
            return gather_for_metrics(accelerator, input_data, layout)
        except ValueError as error:
            raise ValueError(
                f"accelerator.gather_for_metrics under sequence parallelism ({error}): it takes per-sample tensors "
                "(alike on an SP group); for the shards' per-token tensors use loss_fn.gather_for_metrics(accelerator, "
                "data, sequence_dim=1), which returns whole sequences"
            ) from None

    return gather


def whole_eval_batch(batch: dict[str, Any], layout: ParallelLayout) -> None:
    """Make an eval batch of the Trainer's (a shard from :class:`~.data.SequenceParallelCollator` with its token
    counts) the collated batch one process holds, in place: each per-token tensor the whole sequences
    (:func:`~ulysses_sp.gather_sequence`, a collective over the SP group) cut back to the collated length, without
    what SP added (``shift_labels``, the counts and a worker's verdict, ``position_ids`` and ``attention_mask``
    where the collator gave none). It is what ``include_for_metrics=["inputs"]`` hands ``compute_metrics`` (the
    whole batch with ``batch_eval_metrics``)."""
    from .data import BATCH_CHECK_KEY, TOKEN_COUNT_KEY

    counts = batch.pop(TOKEN_COUNT_KEY)
    added = ["shift_labels", BATCH_CHECK_KEY, *["position_ids"] * (not counts[3])]
    for key in added + ["attention_mask"] * bool(counts[1] < 0):
        batch.pop(key, None)
    length = int(counts[2])
    for key in SHARDED_KEYS:
        if key in batch:
            batch[key] = gather_sequence(batch[key], layout)[:, :length]


def gather_objects(accelerator: Any, input_data: Any, layout: ParallelLayout) -> list[Any]:
    """Accelerate's ``gather_for_metrics(..., use_gather_object=True)`` under SP: ``input_data`` (a list of this
    batch's per-sample objects, alike on the ranks of an SP group: ValueError on every rank if not) from each dp
    group once, concatenated in dp order, cut to the last batch's real samples at the end of a dataloader."""
    with replicas_agree(layout):
        seen = _unlike_in_group(hashlib.sha256(pickle.dumps(input_data)).hexdigest()[:16], layout)
        if seen is not None:
            raise ValueError(
                "gather_for_metrics: the ranks of an SP group hold different objects (pickled digests "
                f"{seen}); gather per-sample objects, alike on the group (a shard's values are no sample's)"
            )
    parts: list[Any] = [input_data]
    if layout.dp > 1:
        parts = [None] * layout.dp
        dist.all_gather_object(parts, input_data, group=layout.dp_group)
    data = [item for part in parts for item in part]  # as accelerate.utils.gather_object joins them
    real = _real_rows(accelerator)
    return data if real is None else data[:real]


def gather_over_dp(data: Any, layout: ParallelLayout, pad_index: int | float = -100) -> Any:
    """Each dp group's tensors ``[b, ...]`` (nested in tuples, lists or dicts; alike on the ranks of a group) ->
    ``[dp * b, ...]`` in dp order on every rank, shorter dims padded at their end with ``pad_index`` (False for
    bool); a scalar counts as one row."""
    from accelerate.utils import recursively_apply

    return recursively_apply(lambda t: _gather_over_dp(t, layout, pad_index), data) if layout.dp > 1 else data


def drop_repeats(accelerator: Any, data: Any, rows: int | None = None) -> Any:
    """Accelerate's cut at the end of a dataloader: the first ``remainder`` rows of each gathered tensor are the
    last batch's real samples, the rest repeat samples to even it out (a scalar is left whole). ``rows``: the rows
    of the batch ``data`` came from, where one dp group reads a dataloader of unknown length (a stream) whole: its
    last batch's rows are its real samples, as accelerate's dispatcher counts them in one process (the Trainer
    repeats each batch's loss by its first batch's size)."""
    from accelerate.utils import recursively_apply

    real = _real_rows(accelerator, rows)
    return data if real is None else recursively_apply(lambda t: t if t.dim() == 0 else t[:real], data)


def without_repeats(inputs: dict[str, Any], repeated: torch.Tensor | None) -> dict[str, Any]:
    """A shard of an eval batch (``labels`` and ``shift_labels`` ``[b, n]``) without targets (-100) in the rows that
    repeat samples (``repeated``, :func:`repeated_rows`): at the end of a dataloader whose last batch accelerate
    evened out over ``dp > 1`` groups, the gathered rows run in dp order and only the first ``remainder`` are samples
    (:func:`drop_repeats`). The batch's loss is then that of its samples, as one process computes it (the repeats
    counted in it before); the same ``inputs`` when no row repeats."""
    if repeated is None:
        return inputs
    return {
        key: value.masked_fill(repeated[:, None].to(value.device), IGNORE_INDEX)  # [b, 1] over [b, n]
        if key in ("labels", "shift_labels")
        else value
        for key, value in inputs.items()
    }


def repeated_rows(accelerator: Any, layout: ParallelLayout, rows: int) -> torch.Tensor | None:
    """Which of the ``rows`` rows of this dp group's eval batch repeat samples (``[rows]`` bool, True = repeat) at
    the end of a dataloader whose last batch accelerate evened out over ``dp > 1`` groups (:func:`drop_repeats`'
    rule); None when none does."""
    real = _real_rows(accelerator)
    if real is None or real >= (layout.dp_rank + 1) * rows:
        return None
    return layout.dp_rank * rows + torch.arange(rows) >= real


def only_logits(outputs: Any, ignore_keys: list[str] | None, model: Any) -> None:
    """Refuse outputs that one process would hand compute_metrics as a tuple with the logits (an MoE model's
    ``aux_loss`` and ``router_logits``, ``hidden_states``): only the logits are gathered as whole sequences,
    and a ``predictions[1]`` written for that tuple would silently read a sample's logits instead."""
    if ignore_keys is None:
        ignore_keys = getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None)
    skipped = {*(ignore_keys if ignore_keys is not None else ["past_key_values"]), "loss", "logits"}
    extra = [k for k in (outputs.keys() if hasattr(outputs, "keys") else ()) if k not in skipped]
    if extra:
        raise ValueError(
            f"the model's outputs hold {extra} beside the logits, which transformers' Trainer would pass to "
            "compute_metrics / predict() as a tuple with the logits; under sequence parallelism only the logits "
            f"are gathered, as whole sequences: pass ignore_keys={extra} to evaluate() / predict() (or set "
            "model.config.keys_to_ignore_at_inference) so that the predictions are the logits alone, as in one "
            "process with those keys ignored"
        )


def _real_rows(accelerator: Any, rows: int | None = None) -> int | None:
    """At the end of a dataloader whose last batch accelerate evened out, how many of its gathered rows are real
    samples (``remainder``; ``rows`` where the length is unknown, see :func:`drop_repeats`); else None: keep all."""
    state = accelerator.gradient_state
    if not state.end_of_dataloader:
        return None
    return state.remainder if state.remainder > 0 else (rows if state.remainder == -1 else None)


def _unlike_in_group(mine: Any, layout: ParallelLayout) -> list[Any] | None:
    """Every SP rank's ``mine`` (a summary of what it holds) when they are not all equal; None when they are (or
    sp == 1). A collective over the SP group."""
    if layout.sp == 1:
        return None
    seen: list[Any] = [None] * layout.sp
    dist.all_gather_object(seen, mine, group=layout.sp_group)
    return seen if any(other != seen[0] for other in seen) else None


def _same_in_group(t: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``t`` when every rank of the SP group holds the same values; ValueError on every rank of it otherwise."""
    seen = _unlike_in_group((tuple(t.shape), str(t.dtype), tensor_digest(t).hex()[:8]), layout)
    if seen is not None:
        held = ", ".join(f"sp_rank {r}: {shape} {dtype} digest {d}" for r, (shape, dtype, d) in enumerate(seen))
        raise ValueError(
            "gather_for_metrics: the ranks of an SP group hold different values for a per-sample tensor "
            f"({held}); pass sequence_dim=1 for per-token tensors of the shards, and reduce a statistic computed "
            "from a shard over layout.sp_group before gathering it"
        )
    return t


def _gather_over_dp(t: torch.Tensor, layout: ParallelLayout, pad_index: int | float) -> torch.Tensor:
    """``[b, ...]`` of each dp group -> ``[dp * b, ...]`` in dp order, shorter dims padded at their end."""
    t = t[None] if t.dim() == 0 else t  # a scalar per group: one row each, as accelerate gathers it
    metas: list[object] = [None] * layout.dp
    dist.all_gather_object(metas, (tuple(t.shape), str(t.dtype)), group=layout.dp_group)
    shapes = [shape for shape, _ in metas]  # type: ignore[misc]
    if len({len(shape) for shape in shapes}) > 1 or len({dtype for _, dtype in metas}) > 1:  # type: ignore[misc]
        raise ValueError(f"gather_for_metrics: the dp groups' tensors differ in rank or dtype: {metas}")
    if any(shape[0] != shapes[0][0] for shape in shapes):
        raise ValueError(
            f"gather_for_metrics: the dp groups hold different batch sizes {[shape[0] for shape in shapes]}; "
            "gather per-sample tensors of the batch (dim 0 the samples)"
        )
    largest = [max(sizes) for sizes in zip(*shapes, strict=True)]
    fill = False if t.dtype == torch.bool else pad_index
    padded = any(shape != tuple(largest) for shape in shapes)
    if padded and not t.dtype.is_floating_point and t.dtype != torch.bool:
        info = torch.iinfo(t.dtype)
        if not (float(fill).is_integer() and info.min <= fill <= info.max):  # every rank sees the same shapes
            raise ValueError(
                f"gather_for_metrics: the dp groups' {t.dtype} rows differ in length and pad_index={pad_index!r} "
                f"does not fit {t.dtype}; pass a pad_index in [{info.min}, {info.max}]"
            )
    send = t.detach().contiguous()
    send = send.to(torch.uint8) if send.dtype == torch.bool else send  # gloo has no bool
    pad = [p for d in reversed(range(1, send.dim())) for p in (0, largest[d] - send.shape[d])]
    if any(pad):
        send = F.pad(send, pad, value=int(fill) if not t.dtype.is_floating_point else fill)
    parts = [torch.empty_like(send) for _ in range(layout.dp)]
    dist.all_gather(parts, send, group=layout.dp_group)
    out = torch.cat(parts)
    return out.to(torch.bool) if t.dtype == torch.bool else out
