"""Checks of a batch or a shard that must give the same verdict on every rank: token ids against the vocabulary,
and the shape of the per-token inputs under sequence parallelism (and the range of a loss's label smoothing).

Used by :func:`ulysses_sp.shard_batch` (on the full batch) and by the model's once-per-forward agreement
(:meth:`ulysses_sp.attention.UlyssesAttention.begin_forward`, on the shard): both report the offending id
with the same message, and both agree across the SP group before any rank raises, so no peer is left waiting.
With several data-parallel replicas (any ``sp``, 1 included), :func:`replicas_agree` then shares the verdict
with the whole world, so a batch refused on one replica stops every replica (they step together).
:func:`gather_reports` is the one all-gather of such reports: it checks that every rank sent the same kind of
report, so ranks out of step (one saving or evaluating alone) raise :class:`RanksOutOfStep`, not read stray bytes.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .comm import all_gather_tensor

if TYPE_CHECKING:
    from .comm import CommStats
    from .layout import ParallelLayout

__all__ = [
    "IGNORE_INDEX",
    "REPORT_SLOTS",
    "PeerRejected",
    "PeersAbsent",
    "RanksOutOfStep",
    "Report",
    "bad_id_message",
    "carry_cut",
    "carry_cut_to_outputs",
    "check_id_ranges",
    "check_kept_logits",
    "check_label_smoothing",
    "check_whole_input",
    "cut_of",
    "cut_problem",
    "first_bad_id",
    "gather_cut_problem",
    "gather_reports",
    "hole_message",
    "id_range",
    "input_problem",
    "mark_cut",
    "peers_join",
    "replicas_agree",
]

IGNORE_INDEX = -100  # a target with this id carries no loss (transformers' and PyTorch's convention)


def hole_message(row: int, token: int) -> str:
    """The refusal of an attention mask with padding between real tokens (token ``token`` of row ``row``)."""
    return (
        f"attention_mask has padding inside row {row} (token {token} is masked between real tokens); Ulysses "
        "supports left and right padding; to pack several documents in a row, give position_ids that restart at 0 "
        "for each document instead of masking between them"
    )


def check_label_smoothing(label_smoothing: float) -> float:
    """``label_smoothing`` checked (a number in [0, 1)), as a float."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1) (0: none), got {label_smoothing!r}")
    return float(label_smoothing)


def bad_id_message(name: str, value: int, vocab_size: int | None, ignore_index: int | None) -> str:
    """The error for id ``value`` of ``name`` outside ``[0, vocab_size)`` (``ignore_index`` allowed for targets)."""
    allowed = f"in [0, {vocab_size})" if vocab_size is not None else "non-negative"
    extra = f" or {ignore_index} (ignored)" if ignore_index is not None else ""
    size = f"outside the vocabulary of {vocab_size} tokens" if vocab_size is not None else "a negative id"
    return f"{name} holds id {value}, {size}: ids must be {allowed}{extra}; check the tokenizer and vocab_size"


def as_ignored(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``targets`` with ``ignore_index`` written as -100 (:data:`IGNORE_INDEX`, what the loss functions skip), so a
    shard from ``shard_batch`` (always -100) and targets marked with another value are both read right."""
    return targets if ignore_index == IGNORE_INDEX else targets.masked_fill(targets == ignore_index, IGNORE_INDEX)


def first_bad_id(ids: torch.Tensor, vocab_size: int | None, ignore_index: int | None) -> int | None:
    """The first id outside ``[0, vocab_size)`` (``ignore_index`` allowed); without vocab_size: negatives only."""
    bad = ids < 0
    if vocab_size is not None:
        bad |= ids >= vocab_size
    if ignore_index is not None:
        bad &= ids != ignore_index
    if not bool(bad.any()):
        return None
    return int(ids[tuple(torch.nonzero(bad)[0].tolist())])


def id_range(
    ids: torch.Tensor | None, ignore_index: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of the ids as long tensors on ``device`` (no host sync); ignore_index and no ids count as 0."""
    if ids is None or ids.numel() == 0:
        zero = torch.zeros((), dtype=torch.long, device=device)
        return zero, zero
    ids = ids.to(device=device, dtype=torch.long)
    if ignore_index is not None:
        ids = ids.masked_fill(ids == ignore_index, 0)
    return ids.min(), ids.max()


def check_id_ranges(ranges: list[list[int]], vocab_size: int | None) -> None:
    """``ranges[r] = [ids min, ids max, targets min, targets max]`` of sp_rank ``r`` (:func:`id_range` of the
    input_ids and of the targets): ValueError naming the rank and the id when any lies outside the vocabulary.
    Every rank holds the same ``ranges``, so every rank gives the same verdict."""
    for rank, (ids_lo, ids_hi, tgt_lo, tgt_hi) in enumerate(ranges):
        for name, lo, hi, ignored in (("input_ids", ids_lo, ids_hi, None), ("labels", tgt_lo, tgt_hi, IGNORE_INDEX)):
            value = lo if lo < 0 else (hi if vocab_size is not None and hi >= vocab_size else None)
            if value is not None:
                where = f"sp_rank {rank}: " if len(ranges) > 1 else ""
                raise ValueError(where + bad_id_message(name, value, vocab_size, ignored))


def input_problem(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int, seq_len: int, sp: int
) -> str | None:
    """What is wrong with a rank's model input ``[batch, seq_len]`` under ``sp`` ranks (None if nothing),
    checked locally."""
    if position_ids is None:
        if sp > 1:
            return (
                "under sequence parallelism the model needs position_ids with the GLOBAL positions of this "
                "rank's tokens (else RoPE restarts at 0 on every shard); pass the output of "
                "ulysses_sp.shard_batch(batch, layout) to the model"
            )
    elif position_ids.dim() != 2 or position_ids.shape[-1] != seq_len or position_ids.shape[0] not in (1, batch):
        return f"position_ids must be [{batch} or 1, {seq_len}], got shape {tuple(position_ids.shape)}"
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != (batch, seq_len)):
        return (
            f"attention_mask must be a 2-D padding mask [{batch}, {seq_len}] under Ulysses, got shape "
            f"{tuple(attention_mask.shape)}; 4-D masks are not supported (documents come from position_ids)"
        )
    return None


_CUT_ATTR = "_ulysses_sp_cut"  # on a shard's position_ids: (sp, ring, sp_rank) of the layout shard_batch cut it for


def cut_of(layout: ParallelLayout) -> tuple[int, int, int]:
    """Which cut of the sequence :func:`ulysses_sp.shard_batch` makes for ``layout`` (which tokens, in which
    order): its ``(sp, ring, sp_rank)``."""
    return (layout.sp, layout.ring, layout.sp_rank)


def mark_cut(position_ids: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    """``position_ids`` marked as a shard of the cut ``cut`` (:func:`cut_of`; None: no mark), for
    :func:`cut_problem`."""
    if cut is not None:
        setattr(position_ids, _CUT_ATTR, cut)
    return position_ids


def carry_cut(source: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """``moved`` (``source`` moved to a device) with ``source``'s mark of :func:`mark_cut`, if any."""
    return mark_cut(moved, getattr(source, _CUT_ATTR, None))


def cut_problem(position_ids: torch.Tensor | None, layout: ParallelLayout) -> str | None:
    """Why a model parallelized on ``layout`` cannot run on ``position_ids`` that shard_batch cut for another
    layout (another sp or ring: another cut or order of the tokens, so a silently wrong loss); None when they
    carry no mark (made by hand) or the same cut."""
    return _other_cut(
        position_ids,
        layout,
        "the shard comes from shard_batch for",
        "this model was parallelized on",
        "its tokens are another cut or order of the sequence than the model's, so the loss and gradients would be "
        "silently wrong; shard with the layout given to parallelize (ulysses_sp.ulysses_context(model).layout)",
    )


def gather_cut_problem(x: torch.Tensor, layout: ParallelLayout) -> str | None:
    """Why :func:`ulysses_sp.gather_sequence` cannot put ``x`` together on ``layout``: it carries the mark of another
    cut (a tensor of shard_batch's output for another layout, or a model's output on one); None when it carries
    none (made by hand, or a new tensor computed from one, such as an argmax) or the same cut."""
    return _other_cut(
        x,
        layout,
        "gather_sequence got a shard cut (by shard_batch, or a model's output on its shard) for",
        "it was given a layout of",
        "it would put the tokens together in another order, silently; gather with the layout the shards were cut for "
        "(the model's: ulysses_sp.ulysses_context(model).layout; UlyssesTrainer's sp_layout)",
    )


def _other_cut(x: object, layout: ParallelLayout, marked: str, given: str, why: str) -> str | None:
    """The message ``{marked} <x's cut>, but {given} <layout's cut>: {why}`` when ``x`` carries the mark of another
    cut than ``layout``'s (:func:`mark_cut`); None when it carries none or the same."""
    cut = getattr(x, _CUT_ATTR, None)
    if cut is None or cut == cut_of(layout):
        return None
    sp, ring, sp_rank = cut
    return (
        f"{marked} sp={sp}, ring={ring} (sp_rank {sp_rank}), but {given} sp={layout.sp}, ring={layout.ring} "
        f"(sp_rank {layout.sp_rank}): {why}"
    )


def carry_cut_to_outputs(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """A forward hook (``with_kwargs=True``) of a parallelized model: its per-token outputs (``logits``, each of
    ``hidden_states``) get the mark of :func:`mark_cut` of the ``position_ids`` it ran on, token for token the same
    cut, so :func:`gather_cut_problem` refuses gathering them for another layout."""
    positions = kwargs.get("position_ids")
    if positions is None and args:
        positions = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("position_ids")
    cut = getattr(positions, _CUT_ATTR, None)
    if cut is None:
        return
    for value in (getattr(output, "logits", None), *(getattr(output, "hidden_states", None) or ())):
        if isinstance(value, torch.Tensor):
            mark_cut(value, cut)


def check_kept_logits(logits_to_keep: object, sp: int) -> None:
    """ValueError for ``logits_to_keep`` (other than 0: all) given to a model running Ulysses attention under
    ``sp > 1``: each rank would keep the last tokens of its own shard, not of the sequence. transformers'
    ``generate()`` passes ``logits_to_keep=1``: without ``plain_attention`` it generated from every rank's whole
    prompt read as shards of one longer sequence (silently wrong tokens where the model lets documents attend to
    each other, OPT's and BioGPT's)."""
    if sp > 1 and logits_to_keep is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            f"logits_to_keep={logits_to_keep!r} under sequence parallelism (sp={sp}) would keep the last tokens of "
            "each rank's shard, not of the sequence; generate() passes it: generate inside `with "
            "ulysses_sp.plain_attention(model):` on the whole input (or after ulysses_sp.unparallelize(model)), and "
            "for a shard's logits pass logits_to_keep=0 (all)"
        )


def check_whole_input(position_ids: torch.Tensor | None) -> None:
    """ValueError for a shard of ``sp > 1`` (position_ids marked by :func:`mark_cut`) run in plain attention (a
    parallelized model inside ``plain_attention``), where each rank's attention would see its own shard alone."""
    cut = getattr(position_ids, _CUT_ATTR, None)
    if cut is not None and cut[0] > 1:
        raise ValueError(
            f"a shard of sp={cut[0]} (shard_batch's output) runs inside plain_attention, where each rank's attention "
            "sees its own shard alone, so the loss and gradients would be silently wrong: plain_attention is for "
            "whole inputs (generate, a forward on one rank); run shards outside it"
        )


class PeerRejected(ValueError):
    """Raised on the ranks of an SP group whose own input was fine because a peer's was not (the peer raises
    the reason)."""


@contextlib.contextmanager
def replicas_agree(layout: ParallelLayout) -> Iterator[None]:
    """Share the verdict of the checks run inside with every rank of ``layout.loss_group``.

    With several data-parallel replicas (``dp > 1``, with or without a sequence split), whose steps (and
    evaluation batches, whose losses are reduced over the world) go together: one flag all-reduce over the
    world; if any rank's checks raised, one all-gather of the reasons, and every rank raises (the same
    ValueError naming the replica and the reason, for a ValueError) instead of the replicas whose batches
    were fine waiting in a collective for those that stopped. A rank whose own check raised something other
    than a ValueError raises that again. With one replica (``dp == 1``) or a rank view: no collective.
    """
    if layout.dp == 1 or layout.is_view:
        yield
        return
    try:
        yield
    except PeersAbsent:
        raise  # a collective here already waited out the timeout: sharing over the world would wait as long again
    except Exception as error:
        _share_verdict(layout, error)
        raise
    _share_verdict(layout, None)


def _share_verdict(layout: ParallelLayout, error: Exception | None) -> None:
    failed = torch.tensor([float(error is not None)], device=layout.device)
    with peers_join("sharing a check's verdict with the other data-parallel replicas"):
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=layout.loss_group)
    if not failed.item():
        return
    mine = None
    if error is not None:
        named = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        mine = (layout.dp_rank, not isinstance(error, PeerRejected), isinstance(error, ValueError), named)
    reports: list = [None] * dist.get_world_size(layout.loss_group)
    dist.all_gather_object(reports, mine, group=layout.loss_group)
    if error is not None and not isinstance(error, ValueError):
        return  # the caller raises this rank's own error again
    failures = [(rank, *report) for rank, report in enumerate(reports) if report is not None]
    # the reason: the first rank that rejected its own input (its SP peers only echo it)
    rank, dp_rank, _, bad_input, reason = next((f for f in failures if f[2]), failures[0])
    replicas = sorted({f[1] for f in failures})
    raise (ValueError if bad_input else RuntimeError)(
        f"data-parallel replica(s) {replicas} rejected their batch, so every rank stops here (the replicas step "
        f"together); rank {rank} (replica {dp_rank}): {reason}"
    ) from error


class PeersAbsent(RuntimeError):
    """Raised by :func:`peers_join`: a collective timed out, or lost a peer, waiting for its group's other ranks."""


@contextlib.contextmanager
def peers_join(doing: str) -> Iterator[None]:
    """Around the first collective of a call that every rank of a group must make: a timeout or a lost connection
    inside (torch's bare "Timed out waiting ...ms" after the process group's timeout, 30 minutes by default, or
    "Connection closed by peer") is raised again as :class:`PeersAbsent`, saying what this rank was ``doing`` and the
    likely cause (a rank that runs it alone: ``if rank == 0: trainer.evaluate()``) and how to wait longer."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if "timed out" in text.lower():
            what = "timed out waiting for the other ranks of its group (they never joined this collective)"
        elif "closed by peer" in text or "reset by peer" in text:
            what = "lost another rank of its group (it ended or died: see its log)"
        else:
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise PeersAbsent(
            f"rank {rank} {what} while {doing}. Every rank of a sequence-parallel group must run ulysses-sp's "
            "collectives together, the same number of times (a forward of the parallelized model, shard_batch, "
            "causal_lm_loss, gather_sequence, UlyssesTrainer's evaluate, predict and saves): not one rank alone (`if "
            "rank == 0: trainer.evaluate()`); for a forward or generate on one rank run the whole input inside `with "
            "ulysses_sp.plain_attention(model):`. If the others were only slow (loading, saving), wait longer: "
            "ulysses_sp.init_default_group(timeout=...) before the layout, `ulysses-sp train --dist-timeout`, "
            f"TrainingArguments(ddp_timeout=...). ({text.splitlines()[0] if text else type(error).__name__})"
        ) from error


class RanksOutOfStep(ValueError):
    """Raised by :func:`gather_reports` when the ranks of a group are not in the same collective."""


class Report(enum.IntEnum):
    """What a rank is doing when it all-gathers a self-checked report (:func:`gather_reports`)."""

    BATCH = 1  # shard_batch's check of a full batch (the collator's, in training and in evaluation)
    FORWARD = 2  # the model's check of its input, once per forward
    FLOS = 3  # UlyssesTrainer's gather of the floating-point operation counts (a log, a checkpoint, train()'s end)

    @property
    def doing(self) -> str:
        return {
            Report.BATCH: "checking a batch (shard_batch: the next training step or evaluation batch)",
            Report.FORWARD: "starting a forward of the model",
            Report.FLOS: "gathering the Trainer's flos counts (logging, saving a checkpoint or ending train())",
        }[self]


_MAGIC = 0x554C_5953_5345_5352  # the first value of every report ("ULYSSESR"): no other collective's bytes match it
REPORT_SLOTS = 32  # every report travels as this many int64s, so two different reports met by mistake read cleanly


def gather_reports(
    report: torch.Tensor, kind: Report, group: dist.ProcessGroup | None, stats: CommStats | None = None
) -> list[list[int]]:
    """Every rank's ``report`` (1-D integers, at most ``REPORT_SLOTS - 3``) in group rank order, gathered in ONE
    all-gather that checks itself.

    Each report travels as ``[magic, kind, length, values..., 0...]`` (``REPORT_SLOTS`` int64s) into zeroed
    buffers, so a rank that met another collective (one rank saving a checkpoint, evaluating, logging or running a
    forward the others do not) finds no valid header where that rank's report should be and raises
    :class:`RanksOutOfStep` saying what each rank is doing, instead of reading the other collective's bytes (two
    of these reports of different kinds are read on both sides; a longer message from elsewhere makes gloo abort).
    """
    assert report.dim() == 1 and report.numel() <= REPORT_SLOTS - 3, tuple(report.shape)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [report.tolist()]
    length = report.numel()
    head = torch.tensor([_MAGIC, int(kind), length], dtype=torch.long, device=report.device)
    send = torch.cat([head, report.to(torch.long), head.new_zeros(REPORT_SLOTS - 3 - length)])
    world = dist.group.WORLD if group is None else group  # comm's None is "no group"; here it is the world
    with peers_join(kind.doing):
        reports = all_gather_tensor(send, world, stats).tolist()  # [size, REPORT_SLOTS], into zeroed parts
    strays = {r: got for r, got in enumerate(reports) if got[:3] != [_MAGIC, int(kind), length]}
    if strays:
        raise RanksOutOfStep(_out_of_step(kind, length, dist.get_rank(group), strays, group))
    return [got[3 : 3 + length] for got in reports]


def _out_of_step(kind: Report, length: int, mine: int, strays: dict[int, list[int]], group: object) -> str:
    def doing(got: list[int]) -> str:
        if got[0] != _MAGIC or got[1] not in {report.value for report in Report}:
            return "in another collective (no ulysses-sp report came from it)"
        if got[1] == kind:  # the same kind of report, another layout: another version of ulysses-sp
            return f"{kind.doing}, with a report of {got[2]} values, not {length} (another ulysses-sp version?)"
        return Report(got[1]).doing

    world = group is None or group is dist.group.WORLD
    where, rank = ("the world", "rank") if world else ("their sequence-parallel group", "sp_rank")
    peers = "; ".join(f"{rank} {r} is {doing(got)}" for r, got in strays.items())
    return (
        f"the ranks of {where} are not in the same collective: {rank} {mine} (this one) is {kind.doing}, but {peers}. "
        "One rank is doing something the others are not (saving a checkpoint, evaluating, logging, or a forward or "
        "collective of its own), so their collectives would mix each other's data; check Trainer callbacks that set "
        "`control` flags (control.should_save / should_evaluate / should_log) on some ranks only, and code that runs "
        "on one rank only (`if rank == 0:` around a forward, a save or a collective): every rank must run the same "
        "collectives in the same order"
    )
