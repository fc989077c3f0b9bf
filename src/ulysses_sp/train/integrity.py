"""Checksums of a checkpoint: written at save, verified before a resume loads anything.

Every file of a checkpoint (weights, tokenizer, optimizer shards, scheduler, RNG and trainer state) has its
SHA-256 in ``checksums.sha256``, in the format of ``sha256sum`` (``cd checkpoint-N && sha256sum -c
checksums.sha256`` checks it by hand). The manifest is written before the completeness marker
``trainer_state.json`` (whose checksum it holds from its content), so a complete checkpoint always has one.
A damaged file is named, together with the newest intact checkpoint to resume from instead.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

__all__ = ["MANIFEST", "Damage", "newest_intact_checkpoint", "verify_checkpoint", "write_manifest"]

MANIFEST = "checksums.sha256"
_CHUNK = 8 << 20  # hashlib releases the GIL for large updates: files hash in parallel threads


class Damage(NamedTuple):
    """What is wrong with a checkpoint: the file (relative to the checkpoint) and how."""

    file: str
    problem: str

    def describe(self, checkpoint: Path) -> str:
        return f"{checkpoint / self.file} {self.problem}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(root: Path, names: list[str]) -> dict[str, str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(root / name), names), strict=True))


def _files(root: Path) -> list[str]:
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(name for name in found if name != MANIFEST)


def write_manifest(directory: str | os.PathLike[str], pending: Mapping[str, bytes] | None = None) -> Path:
    """Hash every file under ``directory`` (plus ``pending``: files about to be written, by content) into
    ``directory/checksums.sha256``; returns its path."""
    root = Path(directory)
    sums = _hash_files(root, _files(root))
    for name, content in (pending or {}).items():
        sums[name] = hashlib.sha256(content).hexdigest()
    path = root / MANIFEST
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())))
        handle.flush()
        os.fsync(handle.fileno())
    return path


def verify_checkpoint(checkpoint: str | os.PathLike[str]) -> Damage | None:
    """None when every file listed in the checkpoint's manifest is there with its checksum and every file there is
    listed (or when the checkpoint has no manifest: written before checksums existed, see :func:`resume_point`'s
    warning); else the first damaged (or unlisted) file."""
    root = Path(checkpoint)
    manifest = root / MANIFEST
    if not manifest.is_file():
        return None
    expected: dict[str, str] = {}
    try:
        for line in manifest.read_text(encoding="utf-8").splitlines():
            digest, name = line.split("  ", 1)
            if len(digest) != 64 or not name or name.startswith("/") or ".." in Path(name).parts:
                raise ValueError(line)
            expected[name] = digest
    except (UnicodeDecodeError, ValueError):
        return Damage(MANIFEST, "is unreadable (not lines of 'SHA256  FILE')")
    missing = [name for name in expected if not (root / name).is_file()]
    if missing:
        return Damage(missing[0], "is missing")
    # a manifest cut short (or a file put there after the save) leaves files nothing verifies; hidden ones aside
    unlisted = [name for name in _files(root) if name not in expected and not name.startswith(".")]
    if unlisted:
        return Damage(unlisted[0], f"is not listed in {MANIFEST} (the manifest is cut short): it cannot be verified")
    actual = _hash_files(root, sorted(expected))
    for name in sorted(expected):
        if actual[name] != expected[name]:
            return Damage(name, f"does not match its checksum in {MANIFEST} (the file is damaged)")
    return None


def newest_intact_checkpoint(checkpoints: list[Path], exclude: Path | None = None) -> Path | None:
    """The newest of ``checkpoints`` (oldest first, as listed) that verifies, other than ``exclude``."""
    for path in reversed(checkpoints):
        if path != exclude and verify_checkpoint(path) is None:
            return path
    return None
