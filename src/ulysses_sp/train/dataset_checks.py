"""Cheap checks of ``--dataset`` before any rank trains (:func:`check_dataset`): the launcher refuses a missing,
mixed, empty, binary or malformed file, and a ``--text-field`` the file does not hold, naming the file and the fix,
from the first bytes of each file (a parquet file's footer); what lies further in is checked when the ranks load
the documents (:func:`ulysses_sp.train.documents.load_documents`).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from typing import Any

from ulysses_sp.train.dataset_files import (
    EMBEDDED_CORPUS,
    builder_of,
    check_text_field,
    local_files,
    readable,
    skipped_files,
    skipped_note,
    suffix,
)
from ulysses_sp.train.documents import _hub_error, _not_text, _too_few_documents
from ulysses_sp.train.errors import first_line
from ulysses_sp.train.hub import HubProbe

__all__ = ["check_dataset"]

_OBJECT = "top-level object"  # a .json file of one object: its keys are the columns

_SNIFF_BYTES = 1 << 16  # how much of each local file check_dataset reads
_SNIFF_FILES = 64  # and of how many files
_BETWEEN_ROWS = re.compile(r"[\s,]*")  # what separates the elements of a JSON array
_ROW_BYTES = 1 << 24  # how far it reads into the first JSON file for one whole row, when none fits in the above


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
        _check_columns(name, file, text_field)
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


def _check_columns(name: str, file: str, text_field: str) -> None:
    """Refuse a parquet file whose footer cannot be read, names no column ``text_field``, or types it as no text
    (numbers, lists, bytes: the ranks would find no document in it)."""
    import pyarrow
    import pyarrow.parquet

    try:
        schema = pyarrow.parquet.read_schema(file)
    except Exception as error:  # pyarrow's own kinds (ArrowInvalid, OSError): name the cause
        raise ValueError(f"{name} is not a readable parquet file ({first_line(error)}); check the file") from None
    if text_field not in schema.names:
        raise ValueError(
            f"{name} has no --text-field column {text_field!r} (it holds {schema.names}); pass the column that holds "
            "the text with --text-field"
        )
    kind = schema.field(text_field).type
    kind = kind.value_type if pyarrow.types.is_dictionary(kind) else kind
    kind = kind.storage_type if isinstance(kind, pyarrow.BaseExtensionType) else kind  # datasets' Json(): strings
    text = pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind) or str(kind) == "string_view"
    if not (text or pyarrow.types.is_null(kind)):  # null: an empty shard; the ranks check the whole data
        raise ValueError(
            f"{name}: its --text-field column {text_field!r} holds {kind}, not text; pass the column that holds the "
            f"text with --text-field (columns: {schema.names})"
        )


def _json_rows(name: str, file: str, head: bytes, complete: bool) -> list[tuple[str, Any]]:
    """The whole rows in ``head`` of a .json/.jsonl file as ``(where, row)``, read as ``datasets`` reads them:
    JSON lines, the elements of a top-level array (a string is a row of the column 'text') or one multi-line
    object (its keys are the columns). ValueError naming the line of a JSON line that does not parse."""
    text = head.decode("utf-8", errors="ignore").removeprefix("\ufeff")  # errors: a character cut at the end
    decoder, rows = json.JSONDecoder(strict=False), []  # datasets' reader takes raw tabs and newlines
    if text.lstrip().startswith("["):
        position = text.index("[") + 1
        while True:
            position = _BETWEEN_ROWS.match(text, position).end()
            try:
                row, position = decoder.raw_decode(text, position)
            except json.JSONDecodeError as error:
                if complete and text[position:].strip() != "]":  # the whole file was read: not a JSON array
                    raise ValueError(f"{name} row {len(rows) + 1} is not JSON ({error}); check the file") from None
                return rows  # the end of the array or of what was read; the ranks read the rest
            rows.append((f"row {len(rows) + 1}", {"text": row} if isinstance(row, str) else row))
    lines = text.split("\n")
    for number, line in enumerate(lines if complete else lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            if not rows and suffix(file) == ".json":  # one object over several lines, or not JSON at all
                with contextlib.suppress(json.JSONDecodeError):
                    return [(_OBJECT, decoder.raw_decode(text.lstrip())[0])]
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
        if where != _OBJECT and not isinstance(row[text_field], str | None):  # (an object's values are columns)
            raise ValueError(f"{name} {where}: {_not_text(text_field, row[text_field])}")
    return len(rows)


def check_dataset(
    source: str, *, text_field: str = "text", eval_fraction: float = 0.0, hub: HubProbe | None = None
) -> list[str]:
    """Cheap checks of ``--dataset`` before any rank trains; ValueError naming the file and the fix. Returns the
    notes to print (files of a directory skipped for their type).

    Local files: they exist, are of one kind, not all empty, and their first 64 KiB are text (UTF-8, no NUL
    byte) or parquet, the whole rows there of ``.json``/``.jsonl`` files JSON objects with ``text_field`` (when
    no row fits in 64 KiB, the first row of the first file, read up to 16 MiB); text files (one document each)
    are at least 2 when ``eval_fraction`` holds some out, and take no ``text_field`` but the default. A hub name:
    its metadata can be read (or is cached; ``hub``: the run's :class:`~ulysses_sp.train.hub.HubProbe`). What lies
    further into the files is checked when the ranks load them.
    """
    if source == EMBEDDED_CORPUS:
        check_text_field(source, None, text_field)
        return []
    files = local_files(source)
    if files is None:
        import datasets

        offline = (hub or HubProbe()).unreachable(source, repo_type="dataset")
        if offline is not None:  # (datasets' own retries take about 25 s, printing a line each)
            raise ValueError(
                f"--dataset {source!r}: {offline}; check the name and the network, or give local "
                ".txt/.jsonl/.json/.parquet files"
            )
        try:
            datasets.load_dataset_builder(source)
        except Exception as error:  # datasets raises many kinds (connection, not found, bad config)
            raise ValueError(_hub_error(source, error)) from None
        return []
    builder = builder_of(source, files)
    check_text_field(source, builder, text_field)
    files = readable(source, files)
    rows = sum(_sniff(source, file, builder, text_field) for file in files[:_SNIFF_FILES])
    if builder == "json" and not rows:  # rows longer than 64 KiB: the first one, further in
        _check_rows(f"--dataset {source!r}: {files[0]}", files[0], *_read_head(files[0], _ROW_BYTES), text_field)
    if builder == "text" and eval_fraction > 0 and len(files) < 2:
        raise ValueError(_too_few_documents(eval_fraction, 1) + " (each text file is one document)")
    skipped = skipped_files(source)
    return [skipped_note(source, skipped)] if skipped else []
