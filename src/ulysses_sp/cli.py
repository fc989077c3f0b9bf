"""The ``ulysses-sp`` command (also ``python -m ulysses_sp``).

``ulysses-sp plan [flags]`` predicts memory and the longest sequence (:mod:`ulysses_sp.plan.cli`).
``ulysses-sp train [flags]`` trains a causal LM with Ulysses sequence parallelism; with no flags it runs the
embedded CPU demo. Started plainly it launches its own local ranks; under torchrun, ``accelerate launch`` or
Slurm it is one rank of theirs (see :mod:`ulysses_sp.train.launch`). Exit status: 0 done, 2 invalid
configuration (the message names the flag), 1 any other failure (the message names the failed rank).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = """usage: ulysses-sp <command> [flags]

commands:
  train    train a causal LM on long sequences with Ulysses sequence parallelism;
           with no flags: a small Llama on the King James Bible, 16K tokens, sp=2 on 2 CPU ranks.
           `ulysses-sp train --help` lists every flag.
  bench    benchmark against DeepSpeed's Ulysses, ring attention and no SP; writes
           benchmarks/results/ (JSON + PNG) and BENCHMARKS.md. `ulysses-sp bench --help`.
  plan     predict per-GPU memory and the longest trainable sequence for a model and layout;
           `--simulate` measures one real step as one rank of it. `ulysses-sp plan --help`.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        return train(rest)
    if command == "bench":
        return bench(rest)
    if command == "plan":
        from ulysses_sp.plan.cli import plan_command

        return plan_command(rest)
    print(f"ulysses-sp: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


def _config_error(error: ValueError, rank: int | None = None) -> int:
    where = f" (rank {rank})" if rank else ""
    print(f"ulysses-sp train: error{where}: {error}", file=sys.stderr, flush=True)
    return 2


ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments(environ) -> bool:
    """Ask the CUDA caching allocator for expandable segments (far less fragmentation when long-sequence
    activations of different sizes come and go) unless the user configured the allocator; before any CUDA
    call, so the ranks this process starts inherit it. Returns whether it was set."""
    if any(name in environ for name in ALLOCATOR_ENV):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the name every torch >= 2.6 reads
    return True


def train(argv: Sequence[str]) -> int:
    """``ulysses-sp train``: validate, then run as a launcher's rank or launch local ranks."""
    from ulysses_sp.train.config import load_config
    from ulysses_sp.train.launch import apply_slurm_env, launch_local, under_launcher

    config = load_config(list(argv))  # exits with status 2 and the flag's name on a bad value
    use_expandable_segments(os.environ)
    try:
        apply_slurm_env(os.environ)
        if under_launcher(os.environ):
            return run_rank(config)
        import torch

        from ulysses_sp.train.loop import resume_point
        from ulysses_sp.train.model_factory import check_model_against_config

        nproc = config.resolved_nproc(torch.cuda.device_count())
        check_model_against_config(config)  # fail before starting any rank
        resume_point(config)
    except ValueError as error:
        return _config_error(error)
    if nproc == 1:
        return run_rank(config)
    return launch_local(argv, nproc)


def bench(argv: Sequence[str]) -> int:
    """``ulysses-sp bench``: run the benchmarks (see :mod:`ulysses_sp.bench.runner`)."""
    from ulysses_sp.bench.runner import main as bench_main

    return bench_main(argv)


def _quiet_libraries() -> None:
    """No per-file progress bars or info logs from transformers/datasets in the ranks' output."""
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def run_rank(config) -> int:
    """Train as one rank (or as the only process); returns the exit status."""
    import torch.distributed as dist
    import yaml

    from ulysses_sp.layout import ParallelLayout
    from ulysses_sp.train.config import config_to_dict
    from ulysses_sp.train.launch import init_process_group
    from ulysses_sp.train.loop import Trainer, resolve_config
    from ulysses_sp.train.metrics import format_summary
    from ulysses_sp.train.model_factory import resolve_ring

    _quiet_libraries()
    init_process_group(config.dist_timeout)
    rank = dist.get_rank()
    try:
        ring = resolve_ring(config)
        layout = ParallelLayout.from_env(config.sp, ring=ring)
        if config.nproc is not None and config.nproc != layout.world_size:
            raise ValueError(f"--nproc {config.nproc} but the launcher started {layout.world_size} ranks")
        if layout.is_main:
            resolved = config_to_dict(resolve_config(config, layout.world_size))
            print("ulysses-sp train, resolved config:", flush=True)
            print(yaml.safe_dump(resolved, sort_keys=False).rstrip().replace("\n", "\n  ").join(["  ", ""]))
            hybrid = f" (ulysses {layout.ulysses} x ring {layout.ring})" if layout.ring > 1 else ""
            print(f"layout: world {layout.world_size} = dp {layout.dp} x sp {layout.sp}{hybrid} on {layout.device}")
        summary = Trainer(config, layout).fit()
        if layout.is_main:
            print(format_summary(summary, os.path.join(config.output_dir, config.metrics_file)), flush=True)
        return 0
    except ValueError as error:
        return _config_error(error, rank)
    finally:
        dist.destroy_process_group()
