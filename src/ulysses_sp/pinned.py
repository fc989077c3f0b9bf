"""Page-locked host buffers of (nearly) the bytes asked for, reused from step to step.

``torch.empty(..., pin_memory=True)`` takes its memory from PyTorch's CachingHostAllocator, which rounds every
request up to the next power of two (``ATen/core/CachingHostAllocator.h``): a 320 MiB layer input takes 512 MiB,
32 of them 16 GiB instead of 10. :class:`PinnedBuffers` instead allocates ordinary (pageable) host memory and
page-locks it with ``cudaHostRegister`` (through ``torch.cuda.cudart()``, as PyTorch's own distributed-checkpoint
staging does); the registration is undone when the buffer's memory is freed. A buffer's size is the request
rounded up to a 32nd of its largest power of two (:func:`buffer_bytes`: at most 1/32 more; 320 MiB stays 320 MiB).

A buffer given back (:meth:`PinnedBuffers.give`) is handed out again for a later request it holds with at most an
eighth to spare (or that it was made for), so a training loop that offloads the same layer inputs every step
registers them once, and one whose lengths vary by a few percent (dynamic padding) mostly too. A request that no
free buffer suits releases the free buffers that no request of the current step took (a run does not keep every
size it has seen). Safe to reuse without waiting
for copies: the offload store issues every copy into and out of a buffer on one side stream, in order
(:mod:`ulysses_sp.offload`).
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Callable

import torch

__all__ = ["PinnedBuffers", "buffer_bytes", "page_lock"]

_SPARE = 8  # a free buffer is handed out for requests it holds with at most 1 / _SPARE of its bytes to spare


def buffer_bytes(nbytes: int) -> int:
    """Bytes of the buffer :class:`PinnedBuffers` makes for ``nbytes``: rounded up to a multiple of a 32nd of the
    largest power of two not above it (at least 4 KiB), so at most 1/32 more (a page more for small ones)."""
    if nbytes <= 0:
        return 0
    granule = max(4096, 1 << max(0, nbytes.bit_length() - 6))
    return -(-nbytes // granule) * granule


def _suits(size: int, nbytes: int) -> bool:
    """Whether a free buffer of ``size`` bytes is handed out for ``nbytes``: it holds them with at most an eighth
    to spare, or it is what :func:`buffer_bytes` would make for them (a small request's page)."""
    return nbytes <= size <= max(buffer_bytes(nbytes), nbytes + nbytes // _SPARE)


def _unlock(pointer: int) -> None:
    for index in range(torch.cuda.device_count()):  # no copy on any device still reads or writes it (rare)
        torch.cuda.synchronize(index)
    error = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if error != 0:
        warnings.warn(f"cudaHostUnregister of a pinned host buffer failed (cudaError {error})", stacklevel=1)


def page_lock(buffer: torch.Tensor) -> torch.Tensor:
    """Page-lock ``buffer``'s host memory (a CPU tensor owning its storage) until that storage is freed."""
    storage = buffer.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {error}): the host may be out of "
            "lockable memory (see `ulimit -l`), or an earlier CUDA error surfaced here"
        )
    # when the memory is freed (the storage's Python object lives as long as it); not at exit, where it all goes
    weakref.finalize(storage, _unlock, pointer).atexit = False
    return buffer


class PinnedBuffers:
    """Page-locked host buffers (uint8), handed out by :meth:`take` and back by :meth:`give`, each for copies to
    and from one device (whose one side stream orders them). ``lock`` page-locks a new buffer (default
    :func:`page_lock`; CUDA only).

    A step is what happens between two moments when every buffer is back (a forward and its backward). A request no
    free buffer suits lets go the free buffers that no request of the current step took (a new sequence length:
    the old sizes go before the new ones are made), and only those.
    """

    def __init__(self, lock: Callable[[torch.Tensor], torch.Tensor] = page_lock) -> None:
        self._lock = lock
        self._free: list[tuple[torch.Tensor, object, int]] = []  # (buffer, device, step it was last taken in)
        self._returned: collections.deque = collections.deque()  # give(): no lock (it may run inside a GC pass)
        self._taken: dict[int, tuple[object, int]] = {}  # id(buffer) -> (device, step), for what is handed out
        self._mutex = threading.Lock()
        self._step = 0
        self.made = 0  # buffers allocated and page-locked so far

    def _collect(self) -> None:
        """Move what :meth:`give` returned into the free list (under the lock)."""
        while self._returned:
            buffer = self._returned.popleft()
            device, step = self._taken.pop(id(buffer))
            self._free.append((buffer, device, step))

    def take(self, nbytes: int, device: object = None) -> torch.Tensor:
        """A page-locked buffer holding at least ``nbytes`` bytes (uint8 ``[size]``, ``size >= nbytes``) for copies
        to and from ``device``: the smallest free one that suits, else a new one of :func:`buffer_bytes`."""
        with self._mutex:
            self._collect()
            if not self._taken:
                self._step += 1  # everything is back: a new step begins
            found = [i for i, (b, d, _) in enumerate(self._free) if d == device and _suits(b.numel(), nbytes)]
            if found:
                index = min(found, key=lambda i: self._free[i][0].numel())
                buffer = self._free.pop(index)[0]
            else:  # let go what this step has not used (unregistered as its memory is freed)
                self._free = [entry for entry in self._free if entry[2] == self._step]
                buffer = None
            if buffer is not None:
                self._taken[id(buffer)] = (device, self._step)
                return buffer
        self.made += 1
        buffer = self._lock(torch.empty(buffer_bytes(nbytes), dtype=torch.uint8))
        with self._mutex:
            self._taken[id(buffer)] = (device, self._step)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Take ``buffer`` (as :meth:`take` gave it) back: nothing reads or writes it any more, except copies
        already queued on its device's side stream, which will also fill it next. Lock-free (a finalizer)."""
        self._returned.append(buffer)

    def free_bytes(self) -> int:
        """Bytes of the buffers given back and not handed out again."""
        with self._mutex:
            self._collect()
            return sum(buffer.numel() for buffer, _, _ in self._free)
