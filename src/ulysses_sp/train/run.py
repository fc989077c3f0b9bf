"""The flow of ``ulysses-sp train``: resolve the run once, then train in this process, in local ranks that this
process launches, or as one rank of torchrun / accelerate / Slurm.

- Plain command: the config is validated, ``--output-dir`` is created and locked, and :func:`resolve_run`
  checks everything that needs no rank (exit 2 with one line on bad input). One rank runs here (``--nproc 1``);
  otherwise :class:`~ulysses_sp.train.launch.LocalRanks` starts the ranks first, which import what training
  needs while the run is resolved and then read the resolved :class:`RunSpec` (a refused run kills them).
- Under another launcher: every rank parses the flags; rank 0 takes the lock and resolves the spec, and
  broadcasts it (or its error) to the others.

Exit status: 0 done, 2 bad input (one line naming the flag or file), 1 a failure (one line when it is one a
user can act on, such as a full disk or non-finite training), 130 Ctrl-C, 143 stopped by SIGTERM after saving,
128 + the signal for a SIGHUP (a closed terminal) or a SIGTERM that saves nothing (one line, whatever ``--nproc``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ulysses_sp.train.errors import RunError, disk_error, first_line, report_error
from ulysses_sp.train.lifeline import (
    PREEMPTED_STATUS,
    RankSignals,
    Stopped,
    die_with_launcher,
    exit_now,
    stopped_by_signals,
)
from ulysses_sp.train.outdir import OutputDirLock, prepare_output_dir

if TYPE_CHECKING:
    from ulysses_sp.train.config import TrainConfig
    from ulysses_sp.train.runspec import RunSpec

__all__ = ["run_rank", "train_command"]


def _print_error(message: str) -> int:
    print(f"ulysses-sp train: error: {message}", file=sys.stderr, flush=True)
    return 2


def train_command(argv: Sequence[str]) -> int:
    """``ulysses-sp train ARGV``; returns the exit status (see the module docstring)."""
    from ulysses_sp.train.launch import SPEC_ENV, apply_slurm_env, local_nproc, usable_cpus

    if SPEC_ENV in os.environ:  # a rank of our own launcher, started while it resolves the run
        exit_now(_launched_rank(Path(os.environ[SPEC_ENV])))  # a process of its own: no module teardown
    from ulysses_sp.train.config import load_config

    config = load_config(list(argv))  # exits with status 2 and the flag's name on a bad value (no torch yet)
    from ulysses_sp.process_group import under_launcher

    try:
        apply_slurm_env(os.environ)
        if under_launcher(os.environ):
            return run_rank(None, config)
        import torch

        nproc = local_nproc(config.nproc, config.sp, torch.cuda.device_count(), usable_cpus())
        lock = OutputDirLock(prepare_output_dir(config.output_dir))
    except ValueError as error:
        return _print_error(str(error))
    except KeyboardInterrupt:
        return _interrupted()
    with lock:
        try:
            return _resolve_and_run(argv, config, nproc, lock)
        except KeyboardInterrupt:  # before the launcher's own handlers are in place
            return _interrupted()
        except Stopped as stopped:
            ranks = "; its ranks were stopped" if nproc > 1 else ""
            message = f"stopped by {stopped} while resolving the run (nothing trained or saved){ranks}"
            print(f"ulysses-sp train: {message}", file=sys.stderr, flush=True)
            return 128 + stopped.signum


def _resolve_and_run(argv: Sequence[str], config: TrainConfig, nproc: int, lock: OutputDirLock) -> int:
    """Resolve the run and train it: here (one process), or in local ranks started first, whose imports overlap
    the resolution (a refused run kills them). Returns the exit status."""
    from ulysses_sp.train.launch import LocalRanks
    from ulysses_sp.train.runspec import resolve_run

    with contextlib.ExitStack() as stack:
        ranks = None
        if nproc > 1:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ulysses-sp-run-"))
            ranks = stack.enter_context(LocalRanks(argv, nproc, Path(tmp) / "run.json", lock_fd=lock.fileno()))
        else:  # SIGTERM and SIGHUP end the command with one line, as LocalRanks has them do (run_rank's own inside)
            stack.enter_context(stopped_by_signals())
        try:
            spec = resolve_run(config, nproc)
        except ValueError as error:
            return _print_error(str(error))
        if ranks is None:
            return run_rank(spec)
        return ranks.train(spec.to_json(), save_on_sigterm=spec.config.save_on_sigterm)


def _launched_rank(spec_file: Path) -> int:
    """A rank of :class:`~ulysses_sp.train.launch.LocalRanks`: end with the launcher, import what training needs
    while the launcher resolves the run, then train on the spec it writes."""
    from ulysses_sp.train.launch import wait_for_spec

    die_with_launcher(os.environ)
    _quiet_libraries()  # imports transformers and datasets
    import ulysses_sp.train.loop  # noqa: F401 (the rest of what run_rank imports: the model code, FSDP2, ...)
    from ulysses_sp.train.runspec import RunSpec

    return run_rank(RunSpec.load(wait_for_spec(spec_file)))


def _interrupted() -> int:
    print("ulysses-sp train: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    return 130


def _quiet_libraries() -> None:
    """No per-file progress bars or logs from transformers/datasets in the ranks' output (errors are ours)."""
    import logging

    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()


def _spec_from_rank_0(config: TrainConfig) -> tuple[RunSpec, OutputDirLock | None]:
    """Under another launcher: rank 0 locks ``--output-dir`` and resolves the run, every rank gets the spec
    (ValueError on every rank when rank 0 found bad input; only rank 0 reports it)."""
    import torch.distributed as dist

    from ulysses_sp.train.config import config_to_dict
    from ulysses_sp.train.runspec import RunSpec, resolve_run

    lock, payload = None, [None]
    flags = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(config_to_dict(config), flags, dst=0)  # each rank's flags: rank 0's would win in silence
    if dist.get_rank() == 0:
        try:
            _check_same_flags(flags)
            if config.nproc is not None and config.nproc != dist.get_world_size():
                raise ValueError(f"--nproc {config.nproc} but the launcher started {dist.get_world_size()} ranks")
            if dist.get_world_size() % config.sp:  # (no --nproc was given: do not name it)
                raise ValueError(
                    f"--sp {config.sp} must divide the number of ranks, but the launcher started "
                    f"{dist.get_world_size()}; start a multiple of {config.sp} ranks or change --sp"
                )
            lock = OutputDirLock(prepare_output_dir(config.output_dir))
            payload = [("spec", resolve_run(config, dist.get_world_size()).to_json())]
        except ValueError as error:
            payload = [("error", str(error))]
    dist.broadcast_object_list(payload, src=0)
    kind, text = payload[0]
    if kind == "error":
        if lock is not None:
            lock.release()
        raise ValueError(text if dist.get_rank() == 0 else "")
    return RunSpec.from_json(text), lock


def _check_same_flags(flags: list[dict]) -> None:
    """ValueError naming the first rank whose flags differ from rank 0's (rank 0 resolves the run for all)."""
    for rank, given in enumerate(flags):
        differ = [key for key in flags[0] if given.get(key) != flags[0][key]]
        if differ:
            shown = ", ".join(
                f"--{key.replace('_', '-')} {given.get(key)!r} (rank 0: {flags[0][key]!r})" for key in differ[:3]
            )
            raise ValueError(
                f"rank {rank} was started with other flags than rank 0 ({shown}); every rank must get the same "
                "command line, since rank 0 resolves the run for all"
            )


def run_rank(spec: RunSpec | None, config: TrainConfig | None = None) -> int:
    """Train as one rank (or as the only process) on ``spec``; under another launcher ``spec`` is None and
    rank 0 resolves it from ``config``. Returns the exit status."""
    import torch.distributed as dist
    import yaml

    from ulysses_sp.layout import ParallelLayout
    from ulysses_sp.process_group import init_default_group, under_launcher
    from ulysses_sp.train.config import config_to_dict
    from ulysses_sp.train.loop import Trainer
    from ulysses_sp.train.metrics import format_summary
    from ulysses_sp.train.model_factory import place_checkpoints, resolve_dtype, smallest_gpu_memory

    _quiet_libraries()
    launched = under_launcher(os.environ)
    settings = spec.config if spec is not None else config
    signals = RankSignals(save_on_sigterm=settings.save_on_sigterm, under_launcher=launched)
    init_default_group(timeout=datetime.timedelta(seconds=settings.dist_timeout))
    rank, lock = dist.get_rank(), None
    try:
        if spec is None:
            spec, lock = _spec_from_rank_0(config)
        config = spec.config
        layout = ParallelLayout.from_env(config.sp, ring=spec.ring)  # uses the group started above
        assert config.nproc == layout.world_size, "the spec was resolved for this world size"
        if layout.is_main:
            print("ulysses-sp train, resolved config:", flush=True)
            resolved = yaml.safe_dump(config_to_dict(config), sort_keys=False).rstrip()
            print(resolved.replace("\n", "\n  ").join(["  ", ""]))
            hybrid = f" (ulysses {layout.ulysses} x ring {layout.ring})" if layout.ring > 1 else ""
            print(f"layout: world {layout.world_size} = dp {layout.dp} x sp {layout.sp}{hybrid} on {layout.device}")
            print(f"  {spec.layout_reason}")
        typed, dtype_line = resolve_dtype(config, layout)  # the one compute dtype of every rank
        if layout.is_main:
            print(dtype_line, flush=True)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
        memory = smallest_gpu_memory(layout)
        placed, choice = place_checkpoints(
            typed, spec.model_config(), layout=layout, gpu_memory_bytes=memory, gpus_per_node=local
        )
        if choice and layout.is_main:
            print(choice, flush=True)
        summary = Trainer(spec, layout, signals, config=placed).fit()
        if layout.is_main:
            metrics = os.path.join(config.output_dir, config.metrics_file)
            print(format_summary(summary, metrics), flush=True)
        return PREEMPTED_STATUS if summary["stopped"] else 0
    except ValueError as error:
        return report_error(str(error), 2, rank) if str(error) else 2
    except RunError as error:
        return report_error(str(error), error.status, rank)
    except KeyboardInterrupt:  # one process, no launcher: Ctrl-C
        return _interrupted()
    except Stopped as stopped:  # one process, no launcher: SIGHUP, or SIGTERM with --no-save-on-sigterm
        saved = " without saving (--no-save-on-sigterm)" if stopped.signum == signal.SIGTERM else ""
        message = f"stopped by {stopped}{saved}; --resume continues from the last checkpoint, if any"
        print(f"ulysses-sp train: {message}", file=sys.stderr, flush=True)
        return 128 + stopped.signum
    except Exception as error:
        message = disk_error(error, settings.output_dir)
        if message is None:
            raise
        return report_error(f"{message} ({first_line(error)})", 1, rank)
    finally:
        signals.restore()
        dist.destroy_process_group()
        if lock is not None:
            lock.release()
