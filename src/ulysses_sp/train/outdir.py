"""The output directory of a run: usable, held by one run at a time, and never emptied by accident.

- :func:`prepare_output_dir` creates ``--output-dir`` and refuses a file or a read-only place, before any
  rank starts (``ulysses-sp bench`` checks its output folders with it too, before measuring).
- :class:`OutputDirLock` holds an exclusive ``flock`` on ``--output-dir/.ulysses-sp.lock`` for the whole
  run: a second run into the same folder is refused, naming the holder's pid. The kernel drops the lock
  when the last process holding it ends (however it ends: a killed run never leaves it stuck); our launcher
  passes the locked descriptor to its ranks, so the folder stays held until every rank is gone.
- :func:`previous_run_files` lists what an earlier run left (checkpoints, the metrics log, TensorBoard
  events, the loss curve): a fresh run refuses such a folder unless ``--overwrite`` is given.
- :func:`set_aside_logs` keeps, on a resume that drops records of later steps (a rewind to an older checkpoint,
  a kill after the last save, or ``--resume`` with no checkpoint at all), the whole earlier metrics file and the
  loss curve under ``abandoned-`` names, as the newer checkpoints are kept: a resume never deletes a record.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ulysses_sp.train.config import TrainConfig

__all__ = [
    "LOCK_FILE",
    "OutputDirLock",
    "abandoned_path",
    "prepare_output_dir",
    "previous_run_files",
    "remove_previous_run",
    "run_artifacts",
    "set_aside_logs",
    "set_aside_note",
    "taken_name",
]

LOCK_FILE = ".ulysses-sp.lock"
TENSORBOARD_DIR = "tensorboard"
LOSS_CURVE = "loss_curve.png"


def prepare_output_dir(output_dir: str, flag: str = "--output-dir") -> Path:
    """Create ``output_dir`` (and its parents) and write a file in it; ValueError naming ``flag`` when it cannot
    hold a run's files (a file in the way, no permission, a read-only filesystem)."""
    path = Path(output_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(
            f"{flag} {output_dir!r} is not a directory (a file of that name, or of one of its parents, "
            f"exists); remove it or choose another {flag}"
        ) from None
    except OSError as error:
        raise ValueError(_unwritable(output_dir, error, flag)) from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(_unwritable(output_dir, error, flag)) from None
    return path


def _unwritable(output_dir: str, error: OSError, flag: str = "--output-dir") -> str:
    reason = error.strerror or str(error)
    return f"{flag} {output_dir!r} is not writable ({reason}); choose a directory this user can write to"


class OutputDirLock:
    """An exclusive lock on ``output_dir`` for the life of this process (and of the ranks it passes
    :meth:`fileno` to); ValueError naming the holder when another run has it. Waits ``wait_s`` seconds first,
    so the ranks of a run killed a moment ago can finish dying."""

    def __init__(self, output_dir: str | os.PathLike[str], *, wait_s: float = 3.0) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ValueError(_unwritable(str(output_dir), error)) from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                holder = os.pread(self._fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
                self.release()
                raise ValueError(
                    f"--output-dir {str(output_dir)!r} is in use by another ulysses-sp train run ({holder}); wait "
                    "for it to end (or stop it), or choose another --output-dir"
                ) from None
            except OSError as error:  # a filesystem without flock (some network mounts): run unlocked
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                return
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)

    def fileno(self) -> int:
        """The locked descriptor (to pass to the ranks, which then hold the lock too)."""
        assert self._fd is not None, "the lock was released"
        return self._fd

    def release(self) -> None:
        """Let go of the lock (the kernel does it too when the process ends)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def run_artifacts(output_dir: str | os.PathLike[str], config: TrainConfig) -> dict[str, Path]:
    """Where a run writes its logs: the metrics file, TensorBoard's event folder, the loss-curve PNG."""
    metrics = Path(output_dir) / config.metrics_file
    return {
        "metrics": metrics,
        "tensorboard": Path(output_dir) / TENSORBOARD_DIR,
        "loss_curve": metrics.with_name(LOSS_CURVE),
    }


def taken_name(name: str) -> str | None:
    """What of a run's own files ``name`` would collide with in ``--output-dir`` (None: nothing), for
    ``--metrics-file``: a metrics file named as the loss curve was overwritten by it at the end of the run."""
    taken = {LOSS_CURVE: "the loss curve written beside the metrics file", LOCK_FILE: "the run's lock file"}
    taken[TENSORBOARD_DIR], taken[".wandb-run-id"] = "the TensorBoard event folder", "the W&B run's id file"
    if re.fullmatch(r"(\.[a-z]+-|abandoned-)?checkpoint-\d+.*", name):  # also one being saved, deleted, set aside
        return "the checkpoints' folders (checkpoint-N)"
    return taken.get(name)


def previous_run_files(output_dir: str | os.PathLike[str], config: TrainConfig) -> list[Path]:
    """What an earlier run left in ``output_dir``: its complete checkpoints and its logs (an empty metrics file, of a
    run that failed before its first record, holds nothing to keep: the next run replaces it)."""
    from ulysses_sp.train.checkpoint import list_checkpoints  # torch: not for ``--help`` and a bad flag

    logs = [
        path
        for path in run_artifacts(output_dir, config).values()
        if path.exists() and not (path.is_file() and path.stat().st_size == 0)
    ]
    return [*list_checkpoints(output_dir), *logs]


def remove_previous_run(output_dir: str | os.PathLike[str], config: TrainConfig) -> list[Path]:
    """``--overwrite``: delete an earlier run's checkpoints and logs (checkpoints renamed first); returns them."""
    from ulysses_sp.train.checkpoint import remove_checkpoint

    removed = previous_run_files(output_dir, config)
    for path in removed:
        if path.name.startswith("checkpoint-"):
            remove_checkpoint(path)
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


def abandoned_path(path: Path, stamp: int) -> Path:
    """``abandoned-<stem>-<stamp><suffix>`` beside ``path`` (``-2``, ``-3``, ... added while that name is taken)."""
    target, count = path.with_name(f"abandoned-{path.stem}-{stamp}{path.suffix}"), 1
    while target.exists():
        count += 1
        target = path.with_name(f"abandoned-{path.stem}-{stamp}-{count}{path.suffix}")
    return target


def set_aside_logs(
    output_dir: str | os.PathLike[str], config: TrainConfig, resume_step: int, *, stamp: int | None = None
) -> list[Path]:
    """A resume from ``resume_step`` (0: ``--resume`` found no checkpoint) whose metrics file holds records of later
    steps, which the resumed log drops: copy the whole file to ``abandoned-metrics-<stamp>.jsonl`` and move the
    loss curve drawn from it to ``abandoned-loss_curve-<stamp>.png``. Returns the new paths (none when nothing
    would be dropped)."""
    from ulysses_sp.train.metrics import read_metrics

    artifacts = run_artifacts(output_dir, config)
    metrics, curve = artifacts["metrics"], artifacts["loss_curve"]
    if not metrics.is_file() or all((r.get("step") or 0) <= resume_step for r in read_metrics(metrics)):
        return []
    stamp = int(time.time()) if stamp is None else stamp
    kept = abandoned_path(metrics, stamp)
    tmp = kept.with_name(kept.name + ".tmp")
    shutil.copy2(metrics, tmp)  # a copy: the resumed log keeps the records up to resume_step
    os.replace(tmp, kept)
    moved = [kept]
    if curve.is_file():
        moved.append(abandoned_path(curve, stamp))
        os.replace(curve, moved[-1])
    return moved


def set_aside_note(step: int, moved: list[Path], metrics_name: str) -> str:
    """The line that tells what a resume from ``step`` moved aside (checkpoints and logs; nothing is deleted)."""
    logs, names = [path for path in moved if not path.is_dir()], ", ".join(path.name for path in moved)
    if step == 0:  # --resume found no checkpoint: only the earlier logs
        return f"the earlier run's logs, moved aside (not deleted): {names}; {metrics_name} starts anew"
    text = f"newer than the resumed step {step}, moved aside (not deleted): {names}"
    if logs:
        text += f"; {metrics_name} keeps the records up to step {step}, {logs[0].name} holds the whole earlier log"
    return text
