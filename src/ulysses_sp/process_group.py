"""Start the default process group: one place for the library, ``ulysses-sp train`` and ``bench``."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["agree_on_layout", "init_default_group", "under_launcher"]


def under_launcher(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun, a Slurm job step) already made this process one rank of a group."""
    return "WORLD_SIZE" in environ and "RANK" in environ


def init_default_group(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Start the default process group, once: from the launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ...) when there is one, else a one-rank group in this process.

    ``backend``: None = ``nccl`` when CUDA is available (each rank on the GPU ``LOCAL_RANK`` names), else
    ``gloo``. ``timeout``: the collectives' timeout (None: torch's default). Does nothing when the default
    group is already initialised.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    options = {} if timeout is None else {"timeout": timeout}
    if under_launcher(os.environ):
        dist.init_process_group(backend, **options)
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
