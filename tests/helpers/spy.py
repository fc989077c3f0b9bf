"""Watching a function of the library while a test runs it (the real function still runs), the aten ops it
dispatches, or what torch.compile compiles."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode


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


class CountOps(TorchDispatchMode):
    """The aten ops dispatched while active, by name (``ops["copy_"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def dynamo_compiles(**config: Any) -> Iterator[Counter]:
    """A fresh dynamo cache (torch keeps one per code object for the whole process), in which reaching the recompile
    limit raises ``FailOnRecompileLimitHit`` where torch would otherwise run the function uncompiled; yields dynamo's
    stats (``["unique_graphs"]``: the graphs compiled so far). ``config``: more ``torch._dynamo.config`` patches."""
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **config):
            yield counters["stats"]
    finally:
        torch._dynamo.reset()
