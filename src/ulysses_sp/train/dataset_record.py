"""What documents a checkpoint trained on, and what changed in ``--dataset`` since: :class:`DatasetRecord`.

A checkpoint's data position counts tokens of the documents it read; a resume over other documents must be
refused, and the refusal should say which file or row changed. The record keeps, for the dataset's documents in
their order (before the held-out split), a short SHA-256 of each one's tokens, its token count and its name
(its file, or its row). Past :data:`MAX_ENTRIES` documents, consecutive documents share one entry (a *block*),
so a record stays small however large the dataset is; a change is then named by the block's first and last
document. The corpus fingerprint stays the authority; the record only describes what differs.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ulysses_sp.train.documents import TokenizedCorpus

__all__ = ["MAX_ENTRIES", "DatasetRecord", "changed_documents"]

MAX_ENTRIES = 4096  # entries a record holds at most: one per document up to this many documents
_DIGEST_HEX = 8  # hex digits of each entry's digest (the corpus fingerprint decides; this only names)
_SHOWN = 3  # changed documents a message names


@dataclass(frozen=True)
class DatasetRecord:
    """The dataset's documents in order, ``block`` documents an entry: each entry's digest (``digests``: 8 hex
    digits an entry, concatenated), token count and name (its first document's, ``.. `` its last's)."""

    documents: int
    block: int
    digests: str
    tokens: list[int]
    names: list[str]

    @classmethod
    def of(cls, corpus: TokenizedCorpus, names: Sequence[str]) -> DatasetRecord:
        """The record of the dataset's documents (``corpus``, in their order) named ``names``."""
        count = corpus.num_docs
        if len(names) != count:
            raise ValueError(f"{len(names)} names for {count} documents")
        block = max(1, math.ceil(count / MAX_ENTRIES))
        offsets = corpus.offsets
        digests, tokens, labels = [], [], []
        for first in range(0, count, block):
            end = min(first + block, count)  # documents first .. end - 1: one run of the flat token array
            digest = hashlib.sha256(np.ascontiguousarray(np.diff(offsets[first : end + 1]), dtype="<i8").tobytes())
            digest.update(np.ascontiguousarray(corpus.tokens[offsets[first] : offsets[end]], dtype="<i4").tobytes())
            digests.append(digest.hexdigest()[:_DIGEST_HEX])
            tokens.append(int(offsets[end] - offsets[first]))
            labels.append(names[first] if end - first == 1 else f"{names[first]} .. {names[end - 1]}")
        return cls(count, block, "".join(digests), tokens, labels)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetRecord:
        return cls(**{key: data[key] for key in ("documents", "block", "digests", "tokens", "names")})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def entries(self) -> list[str]:
        """Each entry's digest."""
        return [self.digests[i : i + _DIGEST_HEX] for i in range(0, len(self.digests), _DIGEST_HEX)]


def changed_documents(saved: DatasetRecord, current: DatasetRecord, what: Callable[[int], str]) -> str | None:
    """What differs between the checkpoint's documents (``saved``) and this run's (``current``), naming each
    changed, added or removed document (a few of them), or None when they are the same. ``what(i)`` says what
    this run's i-th entry is to the run (a training or a held-out document)."""
    if saved.block != current.block:  # a record of another granularity: the counts alone compare
        if saved.documents == current.documents:
            return None
        return f"--dataset holds {current.documents} documents, {saved.documents} at the checkpoint"
    old, new = saved.entries(), current.entries()
    if old == new and saved.tokens == current.tokens:
        return None
    changes: list[str] = []
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, old_first, old_end, new_first, new_end in matcher.get_opcodes():
        if tag == "equal":
            continue
        for offset in range(max(old_end - old_first, new_end - new_first)):
            i, j = old_first + offset, new_first + offset
            if i < old_end and j < new_end:
                changes.append(
                    f"{what(j)} {current.names[j]} differs ({saved.tokens[i]} tokens at the checkpoint, "
                    f"{current.tokens[j]} now)"
                )
            elif j < new_end:
                changes.append(f"{what(j)} {current.names[j]} is new ({current.tokens[j]} tokens)")
            else:
                changes.append(f"the checkpoint's {saved.names[i]} is gone ({saved.tokens[i]} tokens)")
    if not changes:
        return None
    if len(new) > 1 and not set(old) & set(new):
        return f"every document of --dataset differs from the checkpoint's (e.g. {changes[0]})"
    more = f" and {len(changes) - _SHOWN} more" if len(changes) > _SHOWN else ""
    counts = f" ({saved.documents} documents then, {current.documents} now)"
    counts = "" if saved.documents == current.documents else counts
    return "; ".join(changes[:_SHOWN]) + more + counts
