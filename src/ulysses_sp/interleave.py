"""Running generators of stages side by side: each step of a generator ends right after it launches an
asynchronous exchange, so that while one waits another computes (the head-chunked attention's chunks,
:mod:`ulysses_sp.head_chunk_pipeline`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable, Iterator

from .head_split import DEPTH

__all__ = ["Stages", "run_interleaved"]

Stages = Generator[None, None, None]


def run_interleaved(chunks: Iterable[Stages], depth: int = DEPTH) -> None:
    """Run the chunk generators, ``depth`` of them alive at once, stepping them in turn (each step ends at the
    launch of an exchange). Deterministic: the same C gives the same order of collectives on every rank."""
    pending: Iterator[Stages] = iter(chunks)
    active: deque[Stages] = deque()

    def step(gen: Stages) -> None:
        try:
            next(gen)
        except StopIteration:
            return
        active.append(gen)

    try:
        while True:
            while len(active) < depth:
                gen = next(pending, None)
                if gen is None:
                    break
                step(gen)
            if not active:
                return
            step(active.popleft())
    finally:
        for gen in active:
            gen.close()
