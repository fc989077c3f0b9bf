"""Which files a --dataset reads: empty parquet files.

Each case was found by a fresh-user trial of ``ulysses-sp train``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ulysses_sp.train.dataset_checks import check_dataset
from ulysses_sp.train.documents import load_documents


def test_an_empty_parquet_file_holds_no_text(tmp_path):
    """A parquet file of no rows was refused as "cannot be read (ArrowInvalid: BatchSize must be greater than 0,
    got 0)", and one such shard in a folder made the whole folder unreadable; an empty .jsonl says it holds no text."""
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    for check in (check_dataset, load_documents):
        with pytest.raises(ValueError, match=r"holds no text: every file is empty \(no rows\)"):
            check(str(empty))
    pq.write_table(pa.table({"text": ["a document", "another"]}), tmp_path / "full.parquet")
    check_dataset(str(tmp_path))
    assert load_documents(str(tmp_path)) == ["a document", "another"]  # the empty shard is left out
