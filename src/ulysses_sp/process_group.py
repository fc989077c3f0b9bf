"""Start the default process group: one place for the library, ``ulysses-sp train`` and ``bench``.

Gloo runs each collective in a worker thread, and the thread drops its last reference to the collective's tensors
just after the caller's wait returns. A tensor whose Python object went first (dropped while the collective ran)
needs the GIL for that, and a thread that asks for the GIL once the interpreter is finalizing is ended by Python,
which C++ turns into an abort ("terminate called without an active exception"): a core dump of a rank that
aborted after a finished Trainer run (2026-11-30) shows a gloo worker in ``~AsyncWork`` freeing an all-gather's
tensors while the main thread ran the interpreter's last garbage collection, after ``destroy_process_group`` or
not. :func:`settle_at_exit` gives the workers that moment: at exit, before finalization, the main thread sleeps
:data:`SETTLE_S` with the GIL released (gloo only).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["SETTLE_S", "agree_on_layout", "init_default_group", "settle_at_exit", "under_launcher"]

SETTLE_S = 0.2  # seconds the main thread leaves gloo's workers at exit (module docstring)


def _settle() -> None:
    time.sleep(SETTLE_S)  # releases the GIL: a worker freeing a collective's tensors gets it before finalization


@functools.cache
def settle_at_exit() -> None:
    """Once per process: at interpreter exit, leave gloo's worker threads :data:`SETTLE_S` to drop what they hold
    while Python can still give them the GIL (module docstring). Called for every gloo default group the library
    starts or finds."""
    atexit.register(_settle)


def _settle_gloo() -> None:
    """:func:`settle_at_exit` where the default group is gloo (for CPU tensors at least) over several ranks."""
    if "gloo" in str(dist.get_backend()) and dist.get_world_size() > 1:
        settle_at_exit()


def under_launcher(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun, a Slurm job step) already made this process one rank of a group."""
    return "WORLD_SIZE" in environ and "RANK" in environ


def init_default_group(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Start the default process group, once: from the launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ...) when there is one, else a one-rank group in this process.

    ``backend``: None = ``nccl`` when CUDA is available (each rank on the GPU ``LOCAL_RANK`` names), else
    ``gloo``. ``timeout``: the collectives' timeout (None: torch's default). Does nothing when the default
    group is already initialised, except that a gloo group of several ranks, started here or found, gets
    :func:`settle_at_exit`.
    """
    if dist.is_initialized():
        _settle_gloo()
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus:  # (CUDA's "invalid device ordinal" on this rank alone, otherwise)
            raise ValueError(
                f"LOCAL_RANK={local_rank}, but this machine shows {gpus} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {gpus} processes per node "
                f"(torchrun --nproc-per-node {gpus}), one per GPU"
            )
        torch.cuda.set_device(local_rank)
    options = {} if timeout is None else {"timeout": timeout}
    if under_launcher(os.environ):
        dist.init_process_group(backend, **options)
        _settle_gloo()
    elif "WORLD_SIZE" in os.environ:
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but RANK is not, so this process cannot tell which rank "
            "it is; start it with torchrun (which sets both) or unset WORLD_SIZE for a one-process run"
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)


def agree_on_layout(sp: int, ring: int, world: int) -> None:
    """ValueError on every rank when the ranks asked for different ``(sp, ring)``: each would build other groups
    and wait in a collective the others never join (one all-gather of the pair over the world, once)."""
    asked: list[tuple[int, int] | None] = [None] * world
    dist.all_gather_object(asked, (sp, ring))
    if len(set(asked)) > 1:
        ranks = "; ".join(f"rank {r}: sp={s}, ring={g}" for r, (s, g) in enumerate(asked) if (s, g) != asked[0])
        raise ValueError(
            f"the ranks asked for different layouts (rank 0: sp={asked[0][0]}, ring={asked[0][1]}; {ranks}): every "
            "rank must build its ParallelLayout (or pass sp_size) with the same sp and ring"
        )
