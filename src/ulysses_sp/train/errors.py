"""Failures of ``ulysses-sp train`` as one line a user can act on, and how a rank hands that line to its launcher.

- ``ValueError``: bad input (a flag, a file); exit status 2, the message names the flag or file and the fix.
- :class:`RunError`: the run cannot go on (non-finite training, a full disk); its own status, usually 1.
- A full or read-only filesystem deep inside a library (safetensors, torch.save, DCP) is recognised by
  :func:`disk_error` and becomes one line naming the directory instead of pages of tracebacks.

Under our own launcher a rank does not print its line: it writes it to ``$ULYSSES_SP_ERROR_DIR/rank-N.txt``
and waits; the launcher sees the file, stops every rank at once (before a peer can fail on the closed
connection and print pages of its own) and prints the line once.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["ERROR_DIR_ENV", "RunError", "disk_error", "first_line", "read_rank_errors", "report_error"]

ERROR_DIR_ENV = "ULYSSES_SP_ERROR_DIR"
_DISK_ERRNOS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
_DISK_ERRNOS[errno.EROFS] = "Read-only file system"
_NEARLY_FULL_BYTES = 64 << 20
_HANDOFF_S = 10.0


class RunError(Exception):
    """The run cannot go on, for a reason the message explains; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def first_line(error: BaseException, *, innermost: bool = True) -> str:
    """The innermost cause of ``error`` (``innermost=False``: ``error`` itself) as one line: what a user can act
    on, without the wrappers."""
    while innermost and (
        error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__)
    ):
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures that DCP's CheckpointException holds."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, Mapping):
            pending += [item[0] if isinstance(item, tuple) else item for item in failures.values()]


def disk_error(error: BaseException, output_dir: str | os.PathLike[str]) -> str | None:
    """One line when ``error`` comes from a full, over-quota or read-only filesystem under ``output_dir``
    (found in its chain by errno or by the OS message a library copied); None for any other error."""
    problem = None
    for item in _chain(error):
        if isinstance(item, OSError) and item.errno in _DISK_ERRNOS:
            problem = _DISK_ERRNOS[item.errno]
            break
        problem = next((text for text in _DISK_ERRNOS.values() if text in str(item)), None)
        if problem is not None:
            break
    if problem is None and "write failed" in str(error):  # torch.save's writer drops the OS error
        try:
            if shutil.disk_usage(output_dir).free < _NEARLY_FULL_BYTES:
                problem = _DISK_ERRNOS[errno.ENOSPC]
        except OSError:
            return None
    if problem is None:
        return None
    return (
        f"{problem} while writing to --output-dir {str(output_dir)!r}: free space there (a partial "
        ".tmp-checkpoint-* goes at the next save) or choose another --output-dir, then continue with --resume"
    )


def report_error(message: str, status: int, rank: int, environ: Mapping[str, str] | None = None) -> int:
    """Print ``message`` as the run's one error line, or hand it to our launcher (see the module docstring);
    returns ``status``."""
    environ = os.environ if environ is None else environ
    error_dir = environ.get(ERROR_DIR_ENV)
    if error_dir:
        path = Path(error_dir) / f"rank-{rank}.txt"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{status}\n{message}\n", encoding="utf-8")
        os.replace(tmp, path)
        time.sleep(_HANDOFF_S)  # the launcher stops us all within a poll; exit by ourselves if it does not
        return status
    where = f" (rank {rank})" if rank else ""
    print(f"ulysses-sp train: error{where}: {message}", file=sys.stderr, flush=True)
    return status


def read_rank_errors(error_dir: str | os.PathLike[str]) -> dict[int, tuple[int, str]]:
    """``{rank: (status, message)}`` handed over with :func:`report_error`, in the order they were written."""
    handed = sorted(Path(error_dir).glob("rank-*.txt"), key=lambda path: (path.stat().st_mtime_ns, path.name))
    errors = {}
    for path in handed:
        try:
            status, message = path.read_text(encoding="utf-8").split("\n", 1)
            errors[int(path.stem.removeprefix("rank-"))] = (int(status), message.strip())
        except (OSError, ValueError):
            continue
    return errors
