"""Page-locked host buffers of (nearly) the bytes asked for, reused from step to step.

``torch.empty(..., pin_memory=True)`` takes its memory from PyTorch's CachingHostAllocator, which rounds every
request up to the next power of two (``ATen/core/CachingHostAllocator.h``): a 320 MiB layer input takes 512 MiB,
32 of them 16 GiB instead of 10. :class:`PinnedBuffers` instead allocates ordinary (pageable) host memory and
page-locks it with ``cudaHostRegister`` (through ``torch.cuda.cudart()``, as PyTorch's own distributed-checkpoint
staging does); the registration is undone when the buffer's memory is freed. A buffer's size is the request
rounded up to a 32nd of its largest power of two (:func:`buffer_bytes`: at most 1/32 more; 320 MiB stays 320 MiB).

A buffer given back (:meth:`PinnedBuffers.give`) is handed out again for a later request it holds with at most an
eighth to spare, so a training loop that offloads the same layer inputs every step registers them once, and one
whose lengths vary by a few percent (dynamic padding) mostly too. A request that no free buffer suits releases
the free buffers that do not suit it (a run does not keep every size it has seen). Safe to reuse without waiting
for copies: the offload store issues every copy into and out of a buffer on one side stream, in order
(:mod:`ulysses_sp.offload`).
"""

from __future__ import annotations

import threading
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


def _unlock(pointer: int) -> None:
    torch.cuda.synchronize()  # no copy still reads or writes it (rare: a buffer's memory is freed)
    torch.cuda.cudart().cudaHostUnregister(pointer)


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
    """Page-locked host buffers (uint8), handed out by :meth:`take` and back by :meth:`give`. ``lock`` page-locks
    a new buffer (default :func:`page_lock`; CUDA only)."""

    def __init__(self, lock: Callable[[torch.Tensor], torch.Tensor] = page_lock) -> None:
        self._lock = lock
        self._free: dict[int, list[torch.Tensor]] = {}
        self._mutex = threading.Lock()  # backward (autograd's device thread) gives back what forward took
        self.made = 0  # buffers allocated and page-locked so far

    def take(self, nbytes: int) -> torch.Tensor:
        """A page-locked buffer holding at least ``nbytes`` bytes (uint8 ``[size]``, ``size >= nbytes``): the
        smallest free one that suits, else a new one of :func:`buffer_bytes`."""
        with self._mutex:
            suits = [size for size in self._free if nbytes <= size <= nbytes + nbytes // _SPARE]
            if suits:
                size = min(suits)
                found = self._free[size].pop()
                if not self._free[size]:
                    del self._free[size]
                return found
            self._free.clear()  # none suits: let them go (unregistered as their memory is freed)
        self.made += 1
        return self._lock(torch.empty(buffer_bytes(nbytes), dtype=torch.uint8))

    def give(self, buffer: torch.Tensor) -> None:
        """Take ``buffer`` (as :meth:`take` gave it) back: nothing reads or writes it any more, except copies
        already queued on the one stream that will also fill it next."""
        with self._mutex:
            self._free.setdefault(buffer.numel(), []).append(buffer)

    def free_bytes(self) -> int:
        """Bytes of the buffers given back and not handed out again."""
        with self._mutex:
            return sum(size * len(found) for size, found in self._free.items())
