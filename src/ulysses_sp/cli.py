"""The ``ulysses-sp`` command (also ``python -m ulysses_sp``).

``ulysses-sp plan [flags]`` predicts memory and the longest sequence (:mod:`ulysses_sp.plan.cli`).
``ulysses-sp train [flags]`` trains a causal LM with Ulysses sequence parallelism; with no flags it runs the
embedded CPU demo. Started plainly it launches its own local ranks; under torchrun, ``accelerate launch`` or
Slurm it is one rank of theirs (see :mod:`ulysses_sp.train.run`). Exit status: 0 done, 2 invalid
configuration (one line naming the flag or file), 1 any other failure, 130 Ctrl-C, 143 stopped by SIGTERM
after saving a checkpoint, 129 SIGHUP (a closed terminal: nothing saved).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["console", "main"]

COMMANDS = ("train", "bench", "plan")

USAGE = """usage: ulysses-sp <command> [flags]   (ulysses-sp --version: the version)

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
    if args[0] in ("-V", "--version"):
        from ulysses_sp import __version__  # (the package's names load lazily: no torch)

        print(f"ulysses-sp {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "train":
        return train(rest)
    if command == "bench":
        return bench(rest)
    if command == "plan":
        use_expandable_segments(os.environ)  # --simulate measures a step as train runs it
        from ulysses_sp.plan.cli import plan_command

        return plan_command(rest)
    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"ulysses-sp: unknown command {command!r}{hint}\n{USAGE}", end="", file=sys.stderr)
    return 2


def console() -> NoReturn:
    """The ``ulysses-sp`` console script and ``python -m ulysses_sp``: :func:`main`, then the exit without the
    interpreter's teardown of the modules it loaded (:func:`~ulysses_sp.train.lifeline.exit_now`: 2-3 s once
    torch and transformers are in)."""
    from ulysses_sp.train.lifeline import exit_now

    exit_now(main())


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
    """``ulysses-sp train``: see :mod:`ulysses_sp.train.run`."""
    from ulysses_sp.train.run import train_command

    use_expandable_segments(os.environ)  # before any CUDA call, so the ranks started here inherit it
    return train_command(argv)


def bench(argv: Sequence[str]) -> int:
    """``ulysses-sp bench``: run the benchmarks (see :mod:`ulysses_sp.bench.runner`)."""
    use_expandable_segments(os.environ)  # the GPU mode measures a training step's memory as train runs it
    from ulysses_sp.bench.runner import main as bench_main

    return bench_main(argv)
