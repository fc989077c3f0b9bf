"""Training data: documents -> token ids (tokenized once, kept in memory) -> fixed-length rows.

Pipeline: the documents are loaded, tokenized and split by :mod:`ulysses_sp.train.documents`; then::

    SequenceLoader(...)            micro-batches of rows of exactly seq_len tokens for one dp rank

Row format (every micro-batch, for every rank, has the same shapes)::

    input_ids       int64 [batch_size, seq_len]   token ids; padding = pad_token_id
    labels          int64 [batch_size, seq_len]   = input_ids, -100 on padding (unshifted: the shift
                                                  happens later, before the sequence is split)
    position_ids    int64 [batch_size, seq_len]   0, 1, 2, ... restarting at every segment (below)
    attention_mask  int64 [batch_size, seq_len]   1 on real tokens, 0 on padding

Position ids rule: a row is a series of *segments*; a segment starts at the start of a document or at
the start of the row. ``position_ids`` count 0, 1, 2, ... from every segment start. So every row
starts with position 0, and a document that continues from the previous row restarts at 0 there (it is
learned as a new document without its earlier context). This keeps every row self-contained, keeps
positions below ``seq_len`` (within the model's trained range), and lets any attention core find the
document boundaries from ``position_ids == 0`` alone. Trailing padding forms its own segment, starting
at 0, so it never attends to real tokens (and real tokens never attend to it, by causality).

Order and resumption: an epoch is one pass over the training documents in an order shuffled by
``(seed, epoch)``, read as one token stream. The loader keeps a cursor into that stream; each
micro-batch takes ``dp_size * batch_size`` consecutive rows from the cursor, and dp rank ``r`` gets
rows ``[r * batch_size, (r + 1) * batch_size)``, so ranks never share a token. Rows are cut at the
sequence length that the schedule gives for the current optimizer step, so a schedule change re-packs
the rest of the epoch at the new length without skipping or repeating a token. The state is
``(epoch, token_index, micro_step)``: the future is a pure function of it (and of the documents, whose
fingerprint the state carries), so resuming from a ``state_dict`` reproduces exactly the same rows (even
with a different dp size or batch size).
At the end of an epoch the last micro-batch is padded (rows without any tokens are fully padded, with
all labels -100), so every rank runs the same number of steps. A row of one token would have no target
(the loss would be 0 and the optimizer would step on no data): a lone last token of a document
(``--no-pack``) or of the epoch's stream is left out, so every micro-batch has something to predict.
With ``epochs=None`` the data repeats, reshuffled each epoch, until the caller stops (at ``max_steps``);
with ``epochs=N`` iteration raises ``StopIteration`` after N passes.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.dataset_record import DatasetRecord, changed_documents
from ulysses_sp.train.documents import (
    TokenizedCorpus,
    held_out_indices,
    load_named_documents,
    pad_token_id,
    split_documents,
    tokenize_documents,
)
from ulysses_sp.train.schedule import SeqLenSchedule
from ulysses_sp.validation import IGNORE_INDEX

__all__ = ["SequenceLoader", "TrainData", "build_data"]


# --- rows and micro-batches --------------------------------------------------------------------------


class SequenceLoader:
    """Micro-batches of fixed-length rows for one data-parallel rank (see the module docstring).

    Args:
        corpus: the tokenized training (or held-out) documents.
        schedule: a fixed sequence length or a :class:`SeqLenSchedule` over optimizer steps.
        batch_size: rows per micro-batch on this dp rank.
        dp_rank, dp_size: this rank's index among the data-parallel groups and their number.
        pack: pack documents back to back (True) or give each document its own windows (False).
        seed: data-order seed; epoch ``e`` is shuffled with ``(seed, e)``.
        shuffle: shuffle the document order each epoch (False for evaluation).
        epochs: stop after this many passes; None = repeat forever.
        grad_accum: micro-batches per optimizer step (the schedule is indexed by optimizer step).
        pad_token_id: id written into padded positions (they are masked and labelled -100).
    """

    def __init__(
        self,
        corpus: TokenizedCorpus,
        *,
        schedule: int | SeqLenSchedule,
        batch_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        pack: bool = True,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        grad_accum: int = 1,
        pad_token_id: int = 0,
    ) -> None:
        if isinstance(schedule, int):
            schedule = SeqLenSchedule(((schedule, None),))
        if corpus.num_tokens == 0:
            raise ValueError("the dataset has no tokens; check --dataset and --text-field")
        if min(length for length, _ in schedule.stages) < 2:
            raise ValueError(
                f"sequence lengths must be >= 2 (a row of one token predicts nothing), got {schedule.stages}"
            )
        if int(np.max(corpus.doc_lengths) if not pack else corpus.num_tokens) < 2:
            raise ValueError("the dataset has no document of two tokens or more: there is nothing to predict")
        if batch_size < 1 or grad_accum < 1:
            raise ValueError(f"batch_size and grad_accum must be >= 1, got {batch_size} and {grad_accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"--epochs must be >= 1 or none, got {epochs}")
        self.corpus = corpus
        self.schedule = schedule
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pack = pack
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.grad_accum = grad_accum
        self.pad_token_id = pad_token_id
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self.reset()

    # --- state ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Go back to the first micro-batch of the first epoch."""
        self.epoch = 0
        self.token_index = 0
        self.micro_step = 0

    @property
    def exhausted(self) -> bool:
        """True once ``epochs`` passes have been consumed."""
        return self.epochs is not None and self.epoch >= self.epochs

    @property
    def step(self) -> int:
        """The optimizer step the next micro-batch belongs to."""
        return self.micro_step // self.grad_accum

    @property
    def seq_len(self) -> int:
        """The sequence length of the next micro-batch."""
        return self.schedule.seq_len_at(self.step)

    def state_dict(self) -> dict[str, Any]:
        """The position in the data (plain ints and bools, JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "token_index": self.token_index,
            "micro_step": self.micro_step,
            "seed": self.seed,
            "pack": self.pack,
            "shuffle": self.shuffle,
            "num_docs": self.corpus.num_docs,
            "num_tokens": self.corpus.num_tokens,
            "fingerprint": self.corpus.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the data, seed and packing mode must be the same."""
        for key in ("seed", "pack", "shuffle", "num_docs", "num_tokens"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(
                    f"cannot resume the data position: saved {key}={state[key]!r} but this run has "
                    f"{self.state_dict()[key]!r}; resume with the same --dataset, --tokenizer, --eval-fraction, "
                    "--seed and --pack"
                )
        if state.get("fingerprint", self.corpus.fingerprint) != self.corpus.fingerprint:
            raise ValueError(
                "cannot resume the data position: the training documents differ from the checkpoint's (as many "
                "documents and tokens, but other text or another order); resume with the same --dataset files "
                "and --tokenizer, or start a new run from the checkpoint's weights with --model <checkpoint>"
            )
        token_index = int(state["token_index"])
        if not 0 <= token_index < self.corpus.num_tokens:
            raise ValueError(f"saved token_index {token_index} lies outside the data ({self.corpus.num_tokens} tokens)")
        self.epoch = int(state["epoch"])
        self.token_index = token_index
        self.micro_step = int(state["micro_step"])

    # --- epoch order ----------------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, stream starts) of an epoch; starts[k] = offset of the k-th document in it."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            num_docs = self.corpus.num_docs
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(num_docs)
            else:
                order = np.arange(num_docs)
            starts = np.zeros(num_docs + 1, dtype=np.int64)
            np.cumsum(self.corpus.doc_lengths[order], out=starts[1:])
            self._epoch_cache = (epoch, order, starts)
        return self._epoch_cache[1], self._epoch_cache[2]

    def _row_end(self, starts: np.ndarray, begin: int, seq_len: int) -> int:
        """End (exclusive) of the row that starts at stream offset ``begin``."""
        end = min(begin + seq_len, int(starts[-1]))
        if not self.pack and begin < end:  # a window never crosses the end of its document
            doc = int(np.searchsorted(starts, begin, side="right")) - 1
            end = min(end, int(starts[doc + 1]))
        return end

    def _row_start(self, starts: np.ndarray, begin: int) -> int:
        """``begin``, or the offset past the lone tokens there: a row of one token has no target (its label is
        shifted out), so a lone last token of a document (``--no-pack``) or of the epoch is never a row."""
        while begin < int(starts[-1]) and self._row_end(starts, begin, 2) - begin < 2:
            begin += 1
        return begin

    def _micro_batch_bounds(self, epoch: int, token_index: int, seq_len: int) -> tuple[list[tuple[int, int]], int]:
        """Stream ranges of the ``dp_size * batch_size`` rows of one micro-batch (empty at the epoch end) and
        the offset where the next micro-batch starts."""
        _, starts = self._epoch_order(epoch)
        bounds = []
        begin = self._row_start(starts, token_index)
        for _ in range(self.dp_size * self.batch_size):
            end = self._row_end(starts, begin, seq_len)
            bounds.append((begin, end))
            begin = self._row_start(starts, end)
        return bounds, begin

    # --- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.exhausted:
            raise StopIteration
        seq_len = self.seq_len
        bounds, self.token_index = self._micro_batch_bounds(self.epoch, self.token_index, seq_len)
        mine = bounds[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        batch = self._make_batch(self.epoch, mine, seq_len)
        self.micro_step += 1
        if self.token_index >= self.corpus.num_tokens:
            self.epoch += 1
            self.token_index = 0
        return batch

    def _make_batch(self, epoch: int, rows: list[tuple[int, int]], seq_len: int) -> dict[str, torch.Tensor]:
        order, starts = self._epoch_order(epoch)
        input_ids = np.full((len(rows), seq_len), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
        attention_mask = np.zeros((len(rows), seq_len), dtype=np.int64)
        for row, (begin, end) in enumerate(rows):
            length = end - begin
            if length:
                tokens, positions = self._gather(order, starts, begin, end)
                input_ids[row, :length] = tokens
                labels[row, :length] = tokens
                position_ids[row, :length] = positions
                attention_mask[row, :length] = 1
            position_ids[row, length:] = np.arange(seq_len - length)  # padding: its own segment from 0
        return {
            "input_ids": torch.from_numpy(input_ids),  # [batch_size, seq_len]
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
            "attention_mask": torch.from_numpy(attention_mask),
        }

    def _gather(self, order: np.ndarray, starts: np.ndarray, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and position ids of the stream range [begin, end), which may span many documents."""
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        last = int(np.searchsorted(starts, end, side="left"))  # documents first .. last-1 overlap the range
        piece_begin = np.maximum(starts[first:last], begin)
        piece_end = np.minimum(starts[first + 1 : last + 1], end)
        piece_len = piece_end - piece_begin
        source = self.corpus.offsets[order[first:last]] + (piece_begin - starts[first:last])
        piece_start_in_row = np.zeros(len(piece_len), dtype=np.int64)
        np.cumsum(piece_len[:-1], out=piece_start_in_row[1:])
        within = np.arange(end - begin, dtype=np.int64) - np.repeat(piece_start_in_row, piece_len)
        tokens = self.corpus.tokens[np.repeat(source, piece_len) + within]
        return tokens, within  # every piece starts a segment: at a document start or at the row start

    # --- planning -------------------------------------------------------------------------------------

    def micro_batches_per_epoch(self, seq_len: int) -> int:
        """Micro-batches in one epoch at a fixed ``seq_len`` (each takes ``dp_size * batch_size`` rows)."""
        lengths = np.array([self.corpus.num_tokens]) if self.pack else self.corpus.doc_lengths
        rows = int(np.sum(lengths // seq_len + (lengths % seq_len >= 2)))  # a lone last token is no row
        return math.ceil(rows / (self.dp_size * self.batch_size))

    def total_micro_batches(self, epochs: int) -> int:
        """Micro-batches in ``epochs`` passes from the start, following the sequence-length schedule."""
        if self.schedule.is_fixed:
            return epochs * self.micro_batches_per_epoch(self.schedule.seq_len_at(0))
        micro_step = 0
        for epoch in range(epochs):
            token_index = 0
            while token_index < self.corpus.num_tokens:
                seq_len = self.schedule.seq_len_at(micro_step // self.grad_accum)
                token_index = self._micro_batch_bounds(epoch, token_index, seq_len)[1]
                micro_step += 1
        return micro_step


# --- everything the training loop needs --------------------------------------------------------------


@dataclass
class TrainData:
    """The tokenizer, the training loader for this rank and the held-out documents (with their indices among the
    dataset's documents and where each comes from, as :func:`load_named_documents` names it), and the record of
    every document of the dataset (:class:`DatasetRecord`, which names what changed before a resume)."""

    tokenizer: Any
    train: SequenceLoader
    eval_corpus: TokenizedCorpus | None
    config: TrainConfig
    dp_rank: int
    dp_size: int
    eval_indices: tuple[int, ...] = ()
    eval_names: tuple[str, ...] = ()
    record: DatasetRecord | None = None

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position, what the held-out documents are (a short digest of each one's tokens:
        a changed held-out document changes the held-out loss, not the training position) and the dataset's
        record (what a resume names when documents changed)."""
        state = self.train.state_dict()
        if self.eval_corpus is not None:
            state["held_out"] = {"indices": list(self.eval_indices), "digests": list(self.eval_digests)}
        if self.record is not None:
            state["dataset"] = self.record.to_dict()
        return state

    @functools.cached_property
    def eval_digests(self) -> list[str]:
        """A short SHA-256 of each held-out document's tokens, in order (made once: every checkpoint saves them)."""
        corpus = self.eval_corpus
        return [] if corpus is None else [_digest(corpus.document(d)) for d in range(corpus.num_docs)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the training documents and the held-out ones must be the same
        (a checkpoint saved before held-out digests existed is checked on its training documents alone). A
        checkpoint with the dataset's record names the documents that changed, were added or were removed."""
        if "dataset" in state and self.record is not None:
            change = changed_documents(DatasetRecord.from_dict(state["dataset"]), self.record, self._role)
            if change is not None:
                raise ValueError(
                    f"cannot resume the data position: the documents of --dataset {self.config.dataset!r} changed "
                    f"since the checkpoint: {change}; resume with the same --dataset files and --tokenizer, or start "
                    "a new run from the checkpoint's weights with --model <checkpoint>"
                )
        self.train.load_state_dict(state)
        saved = state.get("held_out")
        if saved is None or self.eval_corpus is None:
            return
        if saved["indices"] != list(self.eval_indices):
            raise ValueError(_changed_held_out("the held-out documents are other documents than the checkpoint's"))
        for name, old, new in zip(self.eval_names, saved["digests"], self.eval_digests, strict=True):
            if old != new:
                raise ValueError(_changed_held_out(f"the held-out document {name} differs from the checkpoint's"))

    def _role(self, entry: int) -> str:
        """What the record's ``entry`` is to this run: a training or a held-out document (or a block of them)."""
        if self.record is None or self.record.block > 1:
            return "one of the documents"
        return "the held-out document" if entry in self.eval_indices else "the training document"

    def eval_loader(self, seq_len: int) -> SequenceLoader | None:
        """A fresh one-pass, unshuffled loader over the held-out documents (None without any)."""
        if self.eval_corpus is None:
            return None
        return SequenceLoader(
            self.eval_corpus,
            schedule=seq_len,
            batch_size=self.config.batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            pack=self.config.pack,
            seed=self.config.seed,
            shuffle=False,
            epochs=1,
            pad_token_id=self.train.pad_token_id,
        )


def build_data(config: TrainConfig, tokenizer: Any, *, dp_rank: int, dp_size: int) -> TrainData:
    """Load, tokenize and split ``config.dataset`` and make this dp rank's training loader.

    Every rank does the same deterministic work, so no communication is needed.
    """
    documents, names = load_named_documents(config.dataset, text_field=config.text_field, split=config.dataset_split)
    corpus = tokenize_documents(documents, tokenizer)
    train_corpus, eval_corpus = split_documents(corpus, config.held_out_fraction(), config.seed)
    held_out = (
        held_out_indices(corpus.num_docs, config.held_out_fraction(), config.seed) if eval_corpus is not None else ()
    )
    train = SequenceLoader(
        train_corpus,
        schedule=config.schedule(),
        batch_size=config.batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        pack=config.pack,
        seed=config.seed,
        shuffle=True,
        epochs=config.epochs,
        grad_accum=config.grad_accum,
        pad_token_id=pad_token_id(tokenizer),
    )
    eval_names = tuple(names[int(index)] for index in held_out)
    record = DatasetRecord.of(corpus, names)
    held = tuple(map(int, held_out))
    return TrainData(tokenizer, train, eval_corpus, config, dp_rank, dp_size, held, eval_names, record)


def _digest(tokens: np.ndarray) -> str:
    """A short SHA-256 of a document's tokens."""
    return hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()[:16]


def _changed_held_out(what: str) -> str:
    return (
        f"cannot resume the data position: {what} (other text, or another --tokenizer), so the held-out loss would "
        "not compare with the earlier one; resume with the same --dataset files and --tokenizer, or start a new run "
        "from the checkpoint's weights with --model <checkpoint>"
    )
