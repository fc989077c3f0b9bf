"""How the ranks of ``ulysses-sp train`` start, and how a failed rank ends the run.

Three ways a run starts:

- Under a launcher (``torchrun``, ``accelerate launch``, ``python -m torch.distributed.run``):
  ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` are set, and this process is one
  rank. If a peer dies, the launcher stops the others; where it does not, a collective gives up after
  ``--dist-timeout`` seconds, so no rank waits forever.
- Under Slurm without torchrun (``srun`` with one task per GPU): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``
  and ``SLURM_LOCALID`` become ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; ``MASTER_ADDR`` defaults to the
  node that ran ``srun`` (``SLURM_LAUNCH_NODE_IPADDR``) and ``MASTER_PORT`` to a port derived from the job id.
  The batch script itself (no job step) is not a rank: there the command launches local ranks.
- Plainly on one machine: the command starts ``--nproc`` local ranks itself with torch's elastic launcher
  (torchrun's), which stops every rank as soon as one fails and reports which one; ``--nproc 1`` runs in
  this process.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import MutableMapping, Sequence

__all__ = ["apply_slurm_env", "expected_world_size", "init_process_group", "launch_local", "under_launcher"]


def apply_slurm_env(environ: MutableMapping[str, str]) -> bool:
    """Map a multi-task Slurm job step to torch's variables (in place); True when it did."""
    if "WORLD_SIZE" in environ or "SLURM_PROCID" not in environ:
        return False
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1") or "1")
    if tasks <= 1:
        return False
    environ["RANK"] = environ["SLURM_PROCID"]
    environ["WORLD_SIZE"] = str(tasks)
    environ["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
    tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", "").split("(")[0]
    if tasks_per_node.isdigit():
        environ["LOCAL_WORLD_SIZE"] = tasks_per_node
    if "MASTER_ADDR" not in environ:
        if "SLURM_LAUNCH_NODE_IPADDR" not in environ:
            raise ValueError("Slurm: cannot tell the address of rank 0; export MASTER_ADDR before srun")
        environ["MASTER_ADDR"] = environ["SLURM_LAUNCH_NODE_IPADDR"]
    if "MASTER_PORT" not in environ:
        environ["MASTER_PORT"] = str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000)
    return True


def under_launcher(environ: MutableMapping[str, str]) -> bool:
    """True when a launcher already made this process one rank of a group."""
    return "WORLD_SIZE" in environ and "RANK" in environ


def expected_world_size(nproc: int | None, num_gpus: int, environ: MutableMapping[str, str]) -> int:
    """How many ranks the run will have, known before any starts: the launcher's ``WORLD_SIZE`` (or the
    Slurm step's task count), else ``--nproc``, else one per GPU, else 2 on a CPU-only machine."""
    if "WORLD_SIZE" in environ:
        return int(environ["WORLD_SIZE"])
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1") or "1") if "SLURM_PROCID" in environ else 1
    if tasks > 1:
        return tasks
    if nproc is not None:
        return nproc
    return num_gpus if num_gpus > 0 else 2


def init_process_group(timeout_s: int) -> None:
    """Initialise the default process group (nccl on GPU, gloo on CPU) with a collective timeout.

    Uses the launcher's environment when there is one, else a one-rank group in this process.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if under_launcher(os.environ):
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def launch_local(argv: Sequence[str], nproc: int) -> int:
    """Run ``python -m ulysses_sp train ARGV`` on ``nproc`` local ranks; returns the exit status.

    On a CPU-only machine each rank gets ``cpu_count // nproc`` threads unless ``OMP_NUM_THREADS`` is set.
    When a rank fails, the launcher stops the others at once; the message names the failed rank and how it
    ended. A configuration error found by the ranks (status 2) gives status 2 here too.
    """
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    args = get_args_parser().parse_args(
        [
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            "--module",
            "ulysses_sp",
        ]
    )
    args.training_script_args = ["train", *argv]  # set here: torchrun's parser would read our flags as its own
    try:
        run(args)
    except SignalException as error:  # Ctrl-C or a kill of this process: the ranks were stopped
        print(f"ulysses-sp train: stopped by {error.sigval.name}; all ranks were stopped", file=sys.stderr)
        return 128 + int(error.sigval)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        if failure.exitcode < 0:
            how = f"was killed by signal {failure.signal_name()}"
        else:
            how = f"exited with status {failure.exitcode}"
        print(
            f"ulysses-sp train: rank {rank} (pid {failure.pid}) {how}; the launcher stopped the other "
            f"{nproc - 1} rank(s). See that rank's error above.",
            file=sys.stderr,
            flush=True,
        )
        return 2 if failure.exitcode == 2 else 1
    return 0
