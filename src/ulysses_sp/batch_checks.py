"""Checks of a full batch before :func:`ulysses_sp.shard_batch` cuts it, made with or without a process group.

:func:`validated` reads the batch's per-token tensors and says what is wrong with it (malformed, ids outside the
vocabulary, a target on padding); :func:`check_batch` turns that into a :class:`BatchCheck` (the refusal and a
fingerprint of every per-token tensor), which the ranks of an SP group compare in one all-gather
(:meth:`BatchCheck.agree`), so a batch refused on one rank, or batches that differ, raise on every rank.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .layout import ParallelLayout
from .validation import (
    IGNORE_INDEX,
    PeerRejected,
    Report,
    bad_id_message,
    first_bad_id,
    gather_reports,
    hole_message,
    replicas_agree,
)

__all__ = [
    "SHARDED_KEYS",
    "BatchCheck",
    "Problem",
    "batch_check",
    "batch_tokens",
    "check_batch",
    "checked_pad_id",
    "compare_in_group",
    "shift_labels",
    "tensor_digest",
    "validated",
]

# The per-token keys shard_batch slices over the sequence; any other key passes through untouched.
SHARDED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels", "inputs_embeds")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[b, N]`` labels -> ``[b, N]`` targets: position t gets ``labels[t + 1]``; the last gets ignore_index."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index).contiguous()


def _as_2d(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2:
        hint = (
            " (1 = token, 0 = padding): a 4-D mask is not supported; give the 2-D padding mask, and packed documents "
            "as position_ids that restart at 0 for each document (their attention is kept apart from those)"
            if name == "attention_mask"
            else ""
        )
        raise ValueError(f"{name} must be [batch, seq_len], got shape {tuple(value.shape)}{hint}")
    return value


def checked_pad_id(pad_token_id: object, vocab_size: int | None) -> int:
    """``pad_token_id`` as an int, or a ValueError naming it: checked at every call, whether or not the batch's length
    needs padding (a ``None`` from a tokenizer without a pad token failed only on lengths not divisible by sp, in
    torch's ``new_full``; an id outside the vocabulary reached the model on the rank holding the padding)."""
    try:
        pad = None if isinstance(pad_token_id, bool) else operator.index(pad_token_id)  # (numpy ints pass)
    except TypeError:
        pad = None
    if pad is None or pad < 0 or (vocab_size is not None and pad >= vocab_size):
        allowed = "a non-negative int" if vocab_size is None else f"an int in [0, {vocab_size})"
        raise ValueError(
            f"pad_token_id={pad_token_id!r}: shard_batch pads input_ids to a multiple of sp with it, so it must be "
            f"{allowed}; the padding is masked and has no target, so any id of the vocabulary works (the "
            "tokenizer's pad_token_id, else its eos_token_id, or 0)"
        )
    return pad


@dataclass(frozen=True)
class Problem:
    """What is wrong with this rank's batch; ``key``/``value`` name an out-of-vocabulary id, for every rank."""

    message: str
    key: int = -1  # index into SHARDED_KEYS of the tensor holding a bad id, or -1
    value: int = 0  # that id


def _bad_id(name: str, ids: torch.Tensor, vocab_size: int | None, ignore_index: int | None) -> Problem | None:
    value = first_bad_id(ids, vocab_size, ignore_index)
    if value is None:
        return None
    return Problem(bad_id_message(name, value, vocab_size, ignore_index), SHARDED_KEYS.index(name), value)


def _tokens(batch: Mapping[str, object]) -> tuple[dict[str, torch.Tensor], Problem | None]:
    """The batch's ``input_ids [b, N]`` or ``inputs_embeds [b, N, hidden]`` (exactly one of them), checked."""
    given = [key for key in ("input_ids", "inputs_embeds") if batch.get(key) is not None]
    if len(given) != 1:
        found = "both" if given else f"neither (keys: {sorted(batch)})"
        return {}, Problem(
            "the batch needs input_ids or inputs_embeds, not both (input_ids [batch, seq_len] or inputs_embeds "
            f"[batch, seq_len, hidden]: the model takes one of them); it has {found}"
        )
    if given == ["inputs_embeds"]:
        embeds = batch["inputs_embeds"]
        embeds = embeds if isinstance(embeds, torch.Tensor) else torch.as_tensor(embeds)
        if embeds.dim() != 3:
            return {}, Problem(f"inputs_embeds must be [batch, seq_len, hidden], got shape {tuple(embeds.shape)}")
        if not embeds.is_floating_point():
            return {}, Problem(f"inputs_embeds must hold floats (the embedded tokens), got dtype {embeds.dtype}")
        tokens = {"inputs_embeds": embeds}
    else:
        try:
            input_ids = _as_2d("input_ids", batch["input_ids"])
        except ValueError as err:
            return {}, Problem(str(err))
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            return {}, Problem(
                f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; cast them with .long()"
            )
        tokens = {"input_ids": input_ids}
    shape = next(iter(tokens.values())).shape
    if shape[0] == 0 or shape[1] == 0:
        return {}, Problem(f"{given[0]} has shape {tuple(shape)}: a batch needs at least one row and token")
    return tokens, None


def batch_tokens(batch: Mapping[str, object]) -> tuple[str, torch.Tensor]:
    """``(key, tokens)``: the batch's ``input_ids [b, N]`` or ``inputs_embeds [b, N, hidden]`` (exactly one of them),
    checked as :func:`validated` checks them; ValueError naming what is wrong."""
    tokens, problem = _tokens(batch)
    if problem is not None:
        raise ValueError(problem.message)
    ((key, value),) = tokens.items()
    return key, value


def validated(
    batch: Mapping[str, object], vocab_size: int | None, ignore_index: int
) -> tuple[dict[str, torch.Tensor], Problem | None]:
    """The batch's per-token tensors as ``[b, N]`` (``inputs_embeds`` ``[b, N, hidden]``; positions ``[b, N]``
    long), and what is wrong with it."""
    full, problem = _tokens(batch)
    if problem is not None:
        return full, problem
    ((tokens_name, tokens),) = full.items()
    b, seq_len = tokens.shape[:2]
    for name in ("labels", "attention_mask", "position_ids", "shift_labels"):
        value = batch.get(name)
        if value is None:
            continue
        try:
            value = _as_2d(name, value).to(tokens.device)
        except ValueError as err:
            return full, Problem(str(err))
        if (
            value.shape[1] != seq_len
            or value.shape[0] not in (b, 1)
            or (name != "position_ids" and value.shape[0] != b)
        ):
            return full, Problem(
                f"{name} has shape {tuple(value.shape)} but {tokens_name} has shape {tuple(tokens.shape)}; "
                f"they must match in [batch, seq_len] (labels are the unshifted input ids, -100 where no loss is "
                "wanted)"
            )
        if name in ("labels", "shift_labels", "position_ids"):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                return full, Problem(f"{name} must hold integers, got dtype {value.dtype}; cast them with .long()")
            value = value.expand(b, seq_len).to(torch.long)  # cross-entropy takes int64 targets
        full[name] = value
    for name, ignored in (("input_ids", None), ("labels", ignore_index), ("shift_labels", ignore_index)):
        if name in full:
            problem = _bad_id(name, full[name], vocab_size, ignored)
            if problem is not None:
                return full, problem
            if ignored is not None and ignored != IGNORE_INDEX:  # the loss functions, like transformers', skip -100
                full[name] = full[name].masked_fill(full[name] == ignored, IGNORE_INDEX)
    return full, _padding_target_problem(full, ignore_index)


def _padding_target_problem(full: dict[str, torch.Tensor], ignore_index: int) -> Problem | None:
    """A target on a padding token that follows real tokens: one process lets that token's query attend to the
    tokens before it (the mask hides padding as a key, not as a query), while every Ulysses core gives padding
    zero output, so the loss term would silently differ. (A left pad sees no key: zero in both.)"""
    mask, labels = full.get("attention_mask"), full.get("labels")
    given = full.get("shift_labels")
    targets = given if given is not None or labels is None else shift_labels(labels)  # ignored: -100 by now
    if mask is None or targets is None:
        return None
    real = mask != 0  # [b, N]
    after_real = ~real & (real.long().cumsum(dim=1) > 0)  # [b, N]: padding with a real token before it
    bad = torch.nonzero(after_real & (targets != IGNORE_INDEX))
    if bad.numel() == 0:
        return None
    row, token = (int(i) for i in bad[0])
    if bool(real[row, token:].any()):  # padding between real tokens: refused whatever its targets
        return Problem(hole_message(row, token))
    where = f"labels[{row}, {token + 1}]" if given is None else f"shift_labels[{row}, {token}]"
    return Problem(
        f"padding token {token} of row {row} (attention_mask 0, after the row's real tokens) has a target "
        f"({where} = {int(targets[row, token])}): one process lets a padding query attend to the tokens before "
        "it, Ulysses gives padding no attention, so this loss term would differ; set the labels to "
        f"{ignore_index} wherever attention_mask is 0 (as transformers' DataCollatorForLanguageModeling does)"
    )


def tensor_digest(x: torch.Tensor) -> bytes:
    """A 128-bit BLAKE2b digest of ``x``'s values as stored (its dtype's bytes, in order)."""
    values = x.detach().contiguous().cpu().reshape(-1)
    return hashlib.blake2b(values.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


def embedding_words(embeds: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """``[b, N, hidden]`` floats -> ``[b, N]`` int64 words that stand for each token's values in a fingerprint: a
    weighted sum of the 16-bit pieces of its values' bits (fixed weights below 2**24: exact integer sums, no
    overflow up to 2**23 pieces a token), computed where the embeddings are, in chunks of tokens of at most
    ``chunk_elements`` pieces; so equal embeddings give equal words on any rank, and they never go to the host."""
    pieces = embeds.detach().contiguous()
    pieces = pieces.view(torch.int16 if pieces.element_size() >= 2 else torch.uint8)  # [b, N, hidden * k]
    gen = torch.Generator().manual_seed(0)
    weights = torch.randint(1, 1 << 24, (pieces.shape[-1],), generator=gen).to(pieces.device)  # [hidden * k]
    chunk = max(1, chunk_elements // max(1, pieces.shape[0] * pieces.shape[-1]))
    words = [((part.long() & 0xFFFF) * weights).sum(dim=-1) for part in pieces.split(chunk, dim=1)]
    return torch.cat(words, dim=1)  # [b, N]


def _fingerprint(x: torch.Tensor | None) -> list[torch.Tensor]:
    """(present, a 128-bit BLAKE2b digest of the values as two int64s) of one full ``[b, N]`` tensor (embeddings
    ``[b, N, hidden]``: of their :func:`embedding_words`): no edit of the ids can cancel out (paired +1/-1 edits
    did in a weighted sum)."""
    if x is None:
        return [torch.tensor(0)] * 3
    digest = tensor_digest(embedding_words(x) if x.is_floating_point() else x.to(torch.long))
    halves = (int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8))
    return [torch.tensor(1), *(torch.tensor(h) for h in halves)]


@dataclass(frozen=True)
class BatchCheck:
    """What :func:`shard_batch`'s checks found in one full batch, made without a process group (in a dataloader
    worker) for the ranks to agree on later with :meth:`agree`: the refusal (None when the batch is fine) and the
    report the SP group compares (problem flag, bad id, batch x seq, a fingerprint of every per-token tensor).
    Made by :func:`check_batch`, or :meth:`refused` for a refusal that came before the batch was read."""

    refusal: str | None
    report: tuple[int, ...]
    vocab_size: int | None = None
    ignore_index: int = IGNORE_INDEX

    @classmethod
    def refused(cls, message: str) -> BatchCheck:
        """The check of a batch refused with ``message`` before its tensors were read (e.g. no labels)."""
        return batch_check({}, Problem(message), None, IGNORE_INDEX)

    def agree(self, layout: ParallelLayout) -> None:
        """A collective over the SP group (and, with ``dp > 1``, one flag all-reduce over the world): raises the
        same kind of ValueError on every rank if any rank's check refused its batch or the SP ranks' batches
        differ, as ``shard_batch(..., check_same_batch=True)`` does on the main process."""
        with replicas_agree(layout):
            if layout.sp > 1 and not layout.is_view:
                compare_in_group(self, layout)
            elif self.refusal is not None:
                raise ValueError(self.refusal)


def check_batch(
    batch: Mapping[str, object], *, vocab_size: int | None = None, ignore_index: int = IGNORE_INDEX
) -> BatchCheck:
    """:func:`shard_batch`'s checks of a full batch without a process group, as data (see :class:`BatchCheck`)."""
    if not isinstance(batch, Mapping):
        return BatchCheck.refused(f"batch must be a dict of [batch, seq_len] tensors, got {type(batch).__name__}")
    full, problem = validated(batch, vocab_size, ignore_index)
    return batch_check(full, problem, vocab_size, ignore_index)


def batch_check(
    full: dict[str, torch.Tensor], problem: Problem | None, vocab_size: int | None, ignore_index: int
) -> BatchCheck:
    tokens = full.get("input_ids", full.get("inputs_embeds"))
    shape = tokens.shape[:2] if tokens is not None else (0, 0)  # [b, N]
    found = problem if problem is not None else Problem("")
    report = [int(problem is not None), found.key, found.value, *shape]
    for name in SHARDED_KEYS:
        report += [int(value) for value in _fingerprint(full.get(name))]
    return BatchCheck(None if problem is None else problem.message, tuple(report), vocab_size, ignore_index)


def compare_in_group(check: BatchCheck, layout: ParallelLayout) -> None:
    """One self-checked all-gather over the SP group of every rank's report (problem, bad id, shape, a fingerprint
    of every per-token tensor): :func:`~ulysses_sp.validation.gather_reports`.

    Raises the same kind of ValueError on every rank if any rank's batch is malformed, holds an id outside
    the vocabulary, or differs from the others' (input_ids, labels, attention_mask, position_ids or
    shift_labels), so no rank goes on into a collective that the others never reach.
    """
    report = torch.tensor(check.report, dtype=torch.long, device=layout.device)
    reports = gather_reports(report, Report.BATCH, layout.sp_group)  # ranks out of step: RanksOutOfStep
    if check.refusal is not None:
        raise ValueError(check.refusal)
    vocab_size, ignore_index = check.vocab_size, check.ignore_index
    bad = {r: rep for r, rep in enumerate(reports) if rep[0]}
    if bad:
        described = "; ".join(
            f"sp_rank {r}: "
            + (
                bad_id_message(SHARDED_KEYS[rep[1]], rep[2], vocab_size, None if rep[1] == 0 else ignore_index)
                if rep[1] >= 0
                else "malformed batch"
            )
            for r, rep in bad.items()
        )
        raise PeerRejected(
            f"rank(s) of this sequence-parallel group rejected their batch ({described}); see their error"
        )
    prints = [rep[3:] for rep in reports]
    if any(p != prints[0] for p in prints):
        differing = sorted(
            {
                name
                for i, name in enumerate(SHARDED_KEYS)
                for p in prints
                if p[2 + 3 * i : 5 + 3 * i] != prints[0][2 + 3 * i : 5 + 3 * i]
            }
        )
        shapes = [tuple(p[:2]) for p in prints]
        raise ValueError(
            f"the ranks of sequence-parallel group {layout.dp_rank} hold different batches (differing: "
            f"{', '.join(differing) or 'shape'}; batch x seq per sp_rank: {shapes}); every rank of an SP group must "
            f"get the SAME full batch: split your data over the {layout.dp} data-parallel groups (e.g. "
            "DistributedSampler(num_replicas=layout.dp, rank=layout.dp_rank)), not over all ranks; other causes: "
            "data that differs between nodes, or a rank that ran a step (or an evaluation) the others did not (a "
            "callback that set control.should_evaluate on one rank only)"
        )
