"""The longest sequence that fits: one doubling-then-bisection search, for the planner and the GPU benchmark."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .memory import plan_memory
from .shape import model_shape

__all__ = ["max_seq_len", "search_longest"]


def search_longest(
    fits: Callable[[int], bool | None], *, start: int, limit: int, granularity: int
) -> tuple[int, list[tuple[int, bool]], bool]:
    """The largest multiple of ``granularity`` up to ``limit`` for which ``fits`` is True (0 if none).

    Doubles from ``start`` while it fits, then bisects between the last length that fit and the first that
    did not. Assumes ``fits`` is monotone (a longer sequence never fits where a shorter one did not).
    ``fits`` may return None to stop the search (a time budget spent): the longest length that fit so far is
    returned. Returns the length, the ``(length, fits)`` trials in the order they ran, and whether the
    search finished (False when ``fits`` stopped it).
    """
    if start % granularity or start <= 0:
        raise ValueError(f"start {start} must be a positive multiple of granularity {granularity}")
    trials: list[tuple[int, bool]] = []
    low, bad, length = 0, None, start
    while length <= limit:
        ok = fits(length)
        if ok is None:
            return low, trials, False
        trials.append((length, ok))
        if not ok:
            bad = length
            break
        low, length = length, length * 2
    if bad is None:
        return low, trials, True
    while bad - low > granularity:
        middle = (low + bad) // 2 // granularity * granularity
        if middle <= low:
            break
        ok = fits(middle)
        if ok is None:
            return low, trials, False
        trials.append((middle, ok))
        low, bad = (middle, bad) if ok else (low, middle)
    return low, trials, True


def max_seq_len(model_config: Any, *, sp: int = 1, granularity: int = 1024, **settings: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``granularity x sp``, or of ``sp`` below that) whose plan fits; 0 if none
    does.

    ``settings`` are :func:`~ulysses_sp.plan.plan_memory`'s (``dp``, ``gpu_memory_bytes``, ``features``, ...).
    Memory grows with the sequence, so a doubling search followed by bisection finds the boundary.
    """
    shape = model_shape(model_config)
    unit = granularity * sp

    def fits(length: int) -> bool:
        return plan_memory(shape, seq_len=length, sp=sp, **settings).fits

    # at most 2^24 units: past that, memory does not bound the length
    longest = search_longest(fits, start=unit, limit=unit << 24, granularity=unit)[0]
    if longest == 0:  # not even one unit: the longest multiple of sp below it (it was reported as 0)
        longest = search_longest(fits, start=sp, limit=unit, granularity=sp)[0]
    return longest
