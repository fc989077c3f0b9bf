"""Crash-safe training checkpoints.

Layout of ``output_dir``::

    checkpoint-0000020/            one complete checkpoint per saved step
        config.json, model.safetensors (or shards + index), generation_config.json   HF format
        tokenizer files                                                               (if given)
        config.yaml                the resolved training config
        optimizer.pt, scheduler.pt torch.save of the (full) optimizer / scheduler state dicts
        optimizer/                 or: sharded states written by every rank (``write_sharded``, e.g. DCP)
        rank-00000.pt ...          per rank: RNG states (python, numpy, torch CPU, CUDA) + rank_state
        checksums.sha256           SHA-256 of every file, trainer_state.json included (see integrity.py)
        trainer_state.json         step, data position, metrics summary (written last)
    .tmp-checkpoint-0000040/       a checkpoint being written (ignored by readers, removed on next save)

Atomicity: a checkpoint is written into a hidden temporary sibling, fsync'ed, and only then renamed to
``checkpoint-{step:07d}`` (``os.replace``, parent fsync'ed): a process killed at any moment leaves either the
new complete checkpoint or none of it. Pruning (``keep_last``) happens after the new one is in place, and a
checkpoint is always renamed to a hidden name before it is deleted (:func:`remove_checkpoint`). Readers find
the newest complete checkpoint by scanning for ``checkpoint-N`` directories that hold ``trainer_state.json``
(no "latest" pointer that could disagree). Resuming from an older step moves the newer ones aside
(:func:`set_aside_newer`).

Distributed use: call :func:`save_checkpoint` on every rank with the same ``step`` (``output_dir`` on a
filesystem all ranks see); state callables are called on every rank (gathering an FSDP2 state dict is
collective), rank 0 writes all but each rank's own ``rank-NNNNN.pt``, and renames.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ulysses_sp.train.config import TrainConfig, save_config
from ulysses_sp.train.integrity import write_manifest
from ulysses_sp.train.outdir import abandoned_path
from ulysses_sp.train.rng import capture_rng_state, restore_rng_state

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
_PREFIX = "checkpoint-"
_TMP = ".tmp-"
_OLD = ".old-"
_DELETING = ".deleting-"
_NAME_RE = re.compile(r"^checkpoint-(\d{7,})$")

StateOrFn = Any  # a state dict, a zero-argument callable returning one, or None


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint at ``step``: ``checkpoint-0000020``."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{_PREFIX}{step:07d}"


# --- discovery and cleanup ---------------------------------------------------------------------------


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest step first (temporary directories are ignored)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME_RE.match(entry.name)
        if match and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``output_dir``, or None."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def clean_incomplete_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove leftovers of interrupted saves and prunes; returns what was removed.

    A checkpoint that was moved aside to be overwritten (same step saved twice) and whose replacement never
    arrived is moved back instead of being deleted.
    """
    root = Path(output_dir)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(_OLD + _PREFIX):
            final = root / entry.name[len(_OLD) :]
            if not final.exists() and (entry / STATE_FILE).is_file():
                os.replace(entry, final)
                _fsync_dir(root)
                continue
        if entry.name.startswith((_TMP + _PREFIX, _OLD + _PREFIX, _DELETING + _PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def remove_checkpoint(path: Path) -> None:
    """Rename, then delete: a kill half-way never leaves a ``checkpoint-N`` that looks complete."""
    hidden = path.with_name(_DELETING + path.name)
    os.replace(path, hidden)  # first make it invisible, then delete
    _fsync_dir(path.parent)
    shutil.rmtree(hidden, ignore_errors=True)


def prune_checkpoints(output_dir: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 = keep all); returns the deleted."""
    if keep_last < 0:
        raise ValueError(f"--keep-last must be >= 0 (0 = keep all), got {keep_last}")
    checkpoints = list_checkpoints(output_dir)
    doomed = checkpoints[:-keep_last] if keep_last else []
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def set_aside_newer(output_dir: str | os.PathLike[str], step: int, *, stamp: int | None = None) -> list[Path]:
    """Resuming from an older step (a rewind): rename the newer checkpoints ``abandoned-checkpoint-N-<stamp>`` (default
    the time) so that pruning keeps the new line of training and a later bare ``--resume`` continues it."""
    moved, stamp = [], int(time.time()) if stamp is None else stamp
    for path in list_checkpoints(output_dir):
        if int(path.name.split("-")[-1]) > step:
            target = abandoned_path(path, stamp)  # -2, -3, ... after a rewind in the same second
            os.replace(path, target)
            moved.append(target)
    return moved


# --- saving ------------------------------------------------------------------------------------------


def _resolve(value: StateOrFn) -> Any:
    return value() if callable(value) else value


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some platforms/filesystems cannot fsync a directory
        _fsync_path(path)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_model(directory: Path, model: Any, state: dict[str, torch.Tensor] | None) -> None:
    if model is not None and hasattr(model, "save_pretrained"):
        # transformers 5 always writes safetensors (the old safe_serialization flag is gone)
        model.save_pretrained(directory, state_dict=state, is_main_process=True)
    elif state is not None:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state.items()},
            directory / "model.safetensors",
            metadata={"format": "pt"},
        )


def _default_barrier(world_size: int) -> Callable[[], None]:
    if world_size == 1:
        return lambda: None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"save_checkpoint with world_size={world_size} needs a barrier: pass barrier= or initialise "
            "torch.distributed first"
        )
    return dist.barrier


def save_checkpoint(
    output_dir: str | os.PathLike[str],
    step: int,
    *,
    model: Any = None,
    model_state: StateOrFn = None,
    tokenizer: Any = None,
    config: TrainConfig | dict[str, Any] | None = None,
    optimizer_state: StateOrFn = None,
    scheduler_state: StateOrFn = None,
    data_state: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    rank_state: Any = None,
    write_sharded: Callable[[Path], None] | None = None,
    keep_last: int = 0,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{step:07d}`` atomically and prune to the newest ``keep_last``.

    Args:
        model: a Hugging Face model; ``model.save_pretrained(dir, state_dict=...)`` writes it (HF format,
            safetensors). Without ``save_pretrained``, ``model_state`` is written to ``model.safetensors``.
        model_state: the full, unsharded state dict, or a callable returning it (called on every rank).
        tokenizer: saved with ``save_pretrained`` when given. config: the resolved :class:`TrainConfig`
            (or a mapping), written as ``config.yaml``.
        optimizer_state, scheduler_state: full state dicts (or callables), written by rank 0.
        data_state, metrics: the data loader position and a summary (JSON-serialisable).
        rank_state: anything per rank; saved in ``rank-NNNNN.pt`` with this rank's RNG states.
        write_sharded: called on every rank with the temporary directory before the save is committed:
            for collective writers such as ``torch.distributed.checkpoint.save`` of sharded optimizer states.
        keep_last: keep this many newest complete checkpoints (0 = all).
        rank, world_size, barrier: the calling process; ``barrier`` defaults to ``torch.distributed.barrier``.

    Returns the path of the new checkpoint.
    """
    name = checkpoint_name(step)
    if keep_last < 0:
        raise ValueError(f"--keep-last must be >= 0 (0 = keep all), got {keep_last}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    barrier = barrier or _default_barrier(world_size)
    root = Path(output_dir)
    final = root / name
    tmp = root / (_TMP + name)

    state = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "saved_at": time.time(),
        "data_state": data_state,
        "metrics": metrics or {},
    }
    try:
        state_text = json.dumps(state, indent=2, allow_nan=True)
    except TypeError as error:
        raise ValueError(f"data_state and metrics must be JSON-serialisable: {error}") from None

    # collectives first, in the same order on every rank
    full_model_state = _resolve(model_state)
    full_optimizer_state = _resolve(optimizer_state)
    full_scheduler_state = _resolve(scheduler_state)

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        clean_incomplete_checkpoints(root)
        tmp.mkdir()
    barrier()

    _torch_save({"rng": capture_rng_state(), "rank_state": rank_state, "rank": rank}, tmp / f"rank-{rank:05d}.pt")

    if rank == 0:
        _write_model(tmp, model, full_model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if isinstance(config, TrainConfig):
            save_config(config, tmp / "config.yaml")
        elif config is not None:
            (tmp / "config.yaml").write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        if full_optimizer_state is not None:
            _torch_save(full_optimizer_state, tmp / "optimizer.pt")
        if full_scheduler_state is not None:
            _torch_save(full_scheduler_state, tmp / "scheduler.pt")
    if write_sharded is not None:
        write_sharded(tmp)
    barrier()  # every rank file is written and fsync'ed

    if rank == 0:
        write_manifest(tmp, {STATE_FILE: state_text.encode("utf-8")})
        (tmp / STATE_FILE).write_text(state_text, encoding="utf-8")  # the completeness marker, last
        _fsync_tree(tmp)
        aside = root / (_OLD + name)
        if final.exists():  # the same step saved again: move the old copy aside, then replace it
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        prune_checkpoints(root, keep_last)
    barrier()  # nobody continues (or starts another save) before the rename
    return final


# --- loading -----------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read; the model weights stay on disk until asked for."""

    path: Path
    step: int
    world_size: int
    data_state: dict[str, Any] | None
    metrics: dict[str, Any]
    config: dict[str, Any] | None
    optimizer_state: Any = None
    scheduler_state: Any = None
    rng_state: dict[str, Any] | None = None
    rank_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The saved weights (CPU tensors) from ``model.safetensors`` or its shards; without tied duplicates (e.g.
        ``lm_head.weight`` tied to the embeddings): load with ``strict=False`` or ``from_pretrained(path)``."""
        return load_model_state_dict(self.path)

    def restore_rng(self) -> bool:
        """Restore this rank's RNG states; False when the checkpoint has none for this rank."""
        if self.rng_state is None:
            return False
        restore_rng_state(self.rng_state)
        return True


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest complete checkpoint inside it."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"--resume {str(path)!r}: no complete checkpoint there (a checkpoint-NNNNNNN directory with "
            f"{STATE_FILE}); pass a checkpoint directory or an --output-dir that holds one"
        )
    return latest


def load_model_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint directory in HF safetensors format (single file or sharded index)."""
    from safetensors.torch import load_file

    path = Path(path)
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")
    shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(path / shard))
    return weights


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    rank: int = 0,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
) -> Checkpoint:
    """Read a checkpoint (or the newest one under an output directory) for ``rank``: step, data position, metrics,
    the config mapping, optimizer/scheduler states, this rank's RNG state and ``rank_state`` (None when fewer ranks
    wrote it); the weights lazily (:meth:`Checkpoint.model_state_dict`). ``weights_only=False``: for states that
    hold arbitrary Python objects."""
    directory = resolve_checkpoint(path)
    try:
        state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(_damaged(directory / STATE_FILE, error)) from None
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}: checkpoint format {state.get('format')!r}, this version reads {FORMAT_VERSION}")

    def read(name: str) -> Any:
        file = directory / name
        if not file.is_file():
            return None
        try:
            return torch.load(file, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise ValueError(_damaged(file, error)) from None

    rank_file = read(f"rank-{rank:05d}.pt") or {}
    return Checkpoint(
        path=directory,
        step=int(state["step"]),
        world_size=int(state["world_size"]),
        data_state=state.get("data_state"),
        metrics=state.get("metrics") or {},
        config=read_saved_config(directory) or None,
        optimizer_state=read("optimizer.pt"),
        scheduler_state=read("scheduler.pt"),
        rng_state=rank_file.get("rng"),
        rank_state=rank_file.get("rank_state"),
        extra={"saved_at": state.get("saved_at")},
    )


def read_saved_config(directory: Path) -> dict[str, Any]:
    """The mapping in a checkpoint's ``config.yaml`` ({} without one); ValueError naming it when damaged."""
    config_file = directory / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if not isinstance(config or {}, dict):
            raise TypeError(f"a {type(config).__name__}, not a mapping")
    except (yaml.YAMLError, UnicodeDecodeError, TypeError) as error:
        raise ValueError(_damaged(config_file, error)) from None
    return config or {}


def _damaged(file: Path, error: BaseException) -> str:  # the error's text would only mislead (weights_only=...)
    return f"checkpoint file {file} cannot be read ({type(error).__name__}): it is damaged; resume from another one"


__all__ = [
    "Checkpoint",
    "checkpoint_name",
    "clean_incomplete_checkpoints",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state_dict",
    "prune_checkpoints",
    "read_saved_config",
    "remove_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "set_aside_newer",
]
