"""Watching a function of the library while a test runs it (the real function still runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def calls_to(owner: Any, name: str, record: Callable[..., Any] = lambda *args, **kwargs: None) -> Iterator[list]:
    """Inside the block, every call of ``owner.name`` appends ``record(*args, **kwargs)`` to the yielded list
    before it runs; the original is put back on exit."""
    calls, function = [], getattr(owner, name)

    def watched(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return function(*args, **kwargs)

    setattr(owner, name, watched)
    try:
        yield calls
    finally:
        setattr(owner, name, function)
