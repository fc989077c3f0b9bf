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
- Plainly on one machine: the command starts ``--nproc`` local ranks itself (:class:`LocalRanks`) and
  holds the TCP store they meet at (as torchrun does). They start while it resolves the run, so their imports
  overlap its own, and a refused run kills them before they read anything. It stops every rank as soon as one
  fails and prints that rank's one error line (or names how it ended); its ranks die with it (see
  :mod:`ulysses_sp.train.lifeline`) and hold the output directory's lock with it. SIGTERM is passed on to
  the ranks, which save at the next step boundary and stop (exit 143); Ctrl-C stops them at once (exit 130,
  one line), as do SIGTERM and SIGHUP while the run is still being resolved (143 / 129, one line, nothing to
  save). ``--nproc 1`` runs in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ulysses_sp.train.errors import ERROR_DIR_ENV, read_rank_errors
from ulysses_sp.train.lifeline import LAUNCHER_PID_ENV, PREEMPTED_STATUS, STOP_SIGNALS, raise_stopped

__all__ = [
    "SPEC_ENV",
    "LocalRanks",
    "apply_slurm_env",
    "expected_world_size",
    "local_nproc",
    "usable_cpus",
    "wait_for_spec",
]

SPEC_ENV = "ULYSSES_SP_RUN_SPEC"  # the run spec file our launcher hands its ranks (see runspec.py)
_POLL_S = 0.1
_STOP_GRACE_S = 120.0  # how long the other ranks may take to finish once one stopped after a SIGTERM save
RANKS_PER_CPU = 4  # local CPU ranks per usable core at most: more only wait on one another (see local_nproc)
_CLOSE_GRACE_S = 8.0  # how long rank 0 may take to close its logs once a rank handed over an error


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


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity: a container's or ``taskset``'s share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_nproc(nproc: int | None, sp: int, num_gpus: int, num_cpus: int) -> int:
    """Processes to launch on this machine: ``nproc`` if set, else one per GPU, else 2 on a CPU-only machine.
    ValueError, before any rank starts, for more than the GPUs (rank r takes GPU r), more than
    :data:`RANKS_PER_CPU` per core on a CPU-only machine (each rank is a process with its own torch, model and
    threads: a thousand ranks on a laptop started until memory or the store gave out), or a count that is not a
    multiple of ``sp``."""
    nproc = nproc if nproc is not None else (num_gpus if num_gpus > 0 else 2)
    if 0 < num_gpus < nproc:  # rank r takes GPU r (LOCAL_RANK): the others failed in CUDA on their ranks
        raise ValueError(
            f"--nproc {nproc} is more than the {num_gpus} GPU(s) this machine shows (each local rank takes one): "
            f"pass --nproc {num_gpus} or fewer, or start ranks on several machines with torchrun or srun"
        )
    limit = RANKS_PER_CPU * num_cpus
    if num_gpus == 0 and nproc > limit:
        fits = limit - limit % sp
        fix = f"pass --nproc {fits} or fewer" if fits else f"lower --sp {sp} to {limit} or fewer"
        raise ValueError(
            f"--nproc {nproc} is more than {RANKS_PER_CPU} ranks per CPU core ({num_cpus} usable here: at most "
            f"{limit}); each CPU rank is a process with its own torch, model and threads, so more only wait on one "
            f"another: {fix}, or start ranks on several machines with torchrun or srun"
        )
    if nproc % sp:
        raise ValueError(
            f"--nproc resolves to {nproc} processes ({num_gpus} GPUs found), which is not a multiple of "
            f"--sp {sp}; pass --nproc explicitly or change --sp"
        )
    return nproc


@dataclass
class _Run:
    """The ranks of one local launch and what happened to them."""

    processes: list[subprocess.Popen]
    signals: list[int] = field(default_factory=list)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.processes if p.poll() is None]

    def kill(self) -> None:
        for process in self.alive():
            process.kill()
        for process in self.processes:
            process.wait()


def _rank_env(nproc: int, port: int, spec_file: Path, error_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")  # the ranks are clients of the store this launcher holds
    env.update({SPEC_ENV: str(spec_file), ERROR_DIR_ENV: str(error_dir), LAUNCHER_PID_ENV: str(os.getpid())})
    return env


class LocalRanks:
    """``nproc`` local ranks of ``python -m ulysses_sp train ARGV``, started on entry, before the run is resolved:
    they import torch, transformers and our modules (seconds) while this process resolves the run, and wait for
    :meth:`train` to write the spec to ``spec_file``. On exit every rank still alive is killed (a refused run:
    they never saw a spec). ``lock_fd`` (the output directory's lock) is passed to them. Until :meth:`train`,
    SIGTERM and SIGHUP raise :class:`~ulysses_sp.train.lifeline.Stopped`, so the ranks and the caller's temporary
    files go too.

    On a CPU-only machine each rank gets ``usable_cpus() // nproc`` threads unless ``OMP_NUM_THREADS`` is set.
    """

    def __init__(self, argv: Sequence[str], nproc: int, spec_file: Path, *, lock_fd: int) -> None:
        self.argv, self.nproc, self.spec_file, self.lock_fd = list(argv), nproc, spec_file, lock_fd
        self.error_dir = spec_file.parent / "errors"
        self.run = _Run([])
        self._previous: dict[int, Any] = {}  # signal handlers replaced on entry

    def __enter__(self) -> LocalRanks:
        import torch
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, world_size=self.nproc, is_master=True, wait_for_workers=False)
        self.error_dir.mkdir(exist_ok=True)
        env = _rank_env(self.nproc, self.store.port, self.spec_file, self.error_dir)
        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // self.nproc))
        command = [sys.executable, "-m", "ulysses_sp", "train", *self.argv]  # the flags only show in `ps`
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
        try:
            for rank in range(self.nproc):
                rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
                process = subprocess.Popen(command, env=rank_env, start_new_session=True, pass_fds=(self.lock_fd,))
                self.run.processes.append(process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.run.kill()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        del self.store

    def train(self, spec_json: str, *, save_on_sigterm: bool) -> int:
        """Hand the ranks the resolved run (``RunSpec.to_json()``, written whole or not at all) and wait for them;
        returns the exit status (see the module docstring)."""
        partial = self.spec_file.with_name(self.spec_file.name + ".partial")
        partial.write_text(spec_json, encoding="utf-8")
        os.replace(partial, self.spec_file)
        previous = {signum: signal.signal(signum, self.run.on_signal) for signum in (signal.SIGINT, *STOP_SIGNALS)}
        try:
            return _monitor(self.run, self.error_dir, save_on_sigterm)
        finally:
            self.run.kill()
            for signum, handler in (previous | self._previous).items():  # the handlers from before the ranks
                signal.signal(signum, handler)
            self._previous = {}


def wait_for_spec(spec_file: Path, poll_s: float = 0.02) -> Path:
    """In a rank of :class:`LocalRanks`: ``spec_file`` once the launcher has written it. Should the launcher die
    first, so does this rank (:func:`~ulysses_sp.train.lifeline.die_with_launcher`); a refused run kills it."""
    while not spec_file.exists():
        time.sleep(poll_s)
    return spec_file


def _monitor(run: _Run, error_dir: Path, save_on_sigterm: bool) -> int:
    """Wait for the ranks; act on the first failure or signal; returns the exit status."""
    nproc = len(run.processes)
    forwarded, stopping_since, handed_since = False, None, None
    while True:
        time.sleep(_POLL_S)
        if run.signals:
            signum = run.signals.pop(0)
            if signum == signal.SIGTERM and save_on_sigterm and not forwarded:
                for process in run.alive():
                    process.send_signal(signal.SIGTERM)  # each rank saves at the next step boundary, together
                forwarded = True
                continue
            run.kill()
            how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
            if signum != signal.SIGTERM:
                saved = ""
            elif forwarded:  # a second SIGTERM while the ranks were saving for the first (a rank stuck?)
                saved = " before the save the first SIGTERM asked for had finished"
            else:
                saved = " without saving (--no-save-on-sigterm)"
            print(f"ulysses-sp train: {how}{saved}; all {nproc} ranks were stopped", file=sys.stderr, flush=True)
            return 128 + signum
        # A rank's own one-line error: stop everyone before a peer fails on the closed connection and prints
        # pages of its own, once rank 0 (which writes the logs) has had time to hand over its error or end.
        handed = read_rank_errors(error_dir)
        statuses = [process.poll() for process in run.processes]
        failed = [rank for rank, status in enumerate(statuses) if status not in (None, 0, PREEMPTED_STATUS)]
        if handed and not failed and 0 not in handed and statuses[0] is None:
            handed_since = handed_since or time.monotonic()
            if time.monotonic() - handed_since < _CLOSE_GRACE_S:
                continue
        if handed or failed:
            return _report_failure(run, failed, error_dir)
        if all(status is not None for status in statuses):
            return PREEMPTED_STATUS if PREEMPTED_STATUS in statuses else 0
        if PREEMPTED_STATUS in statuses:  # the others are finishing the same save: give them time, not forever
            stopping_since = stopping_since or time.monotonic()
            if time.monotonic() - stopping_since > _STOP_GRACE_S:
                run.kill()
                print("ulysses-sp train: ranks did not stop after the SIGTERM save; they were killed", file=sys.stderr)
                return PREEMPTED_STATUS


def _report_failure(run: _Run, failed: list[int], error_dir: Path) -> int:
    """Stop the other ranks; print the failed rank's own error line, or how it ended; returns the status."""
    run.kill()
    handed = read_rank_errors(error_dir)
    if handed:
        rank = 0 if 0 in handed else next(iter(handed))  # rank 0's when it has one, else the first written
        status, message = handed[rank]
        where = f" (rank {rank})" if rank else ""
        print(f"ulysses-sp train: error{where}: {message}", file=sys.stderr, flush=True)
        return status
    rank = failed[0]
    process = run.processes[rank]
    status = process.returncode
    how = f"was killed by signal {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
    print(
        f"ulysses-sp train: rank {rank} (pid {process.pid}) {how}; the launcher stopped the other "
        f"{len(run.processes) - 1} rank(s). See that rank's error above.",
        file=sys.stderr,
        flush=True,
    )
    return 2 if status == 2 else 1
