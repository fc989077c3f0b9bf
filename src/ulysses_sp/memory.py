"""Measure the peak memory that a piece of code allocates, on CUDA and on the CPU alike.

``with PeakMemory(device) as peak: ...`` then ``peak.peak_bytes`` is the highest number of bytes held by
tensors that were allocated inside the block, above what was allocated when it began (the block's "extra"
memory, the quantity a memory plan predicts).

* CUDA: the caching allocator's own counters (``torch.cuda.max_memory_allocated``), reset on entry.
* CPU: PyTorch keeps no allocation counters for the CPU, so a :class:`TorchDispatchMode` sees the output of
  every operator (forward and backward), records each new storage once (views share their base's storage)
  and subtracts it when the storage is freed. It counts tensor storages, not allocator slack or kernels'
  internal scratch space, which is what ``torch.cuda.max_memory_allocated`` counts too. It slows every
  operator a little, so use it for measurements, not in training.
"""

from __future__ import annotations

import weakref
from types import TracebackType

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory"]


class _StorageTracker(TorchDispatchMode):
    """Live bytes of the storages created by operators inside the mode, and their peak."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # e.g. a DTensor: count the local tensors it wraps
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if tensor.device.type != self.device_type or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.live:
            return
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out


class PeakMemory:
    """Context manager: the peak bytes allocated inside the block above the allocation at its start.

    Args:
        device: where the block computes (``"cpu"``, ``"cuda"``, ``torch.device("cuda:1")``).

    After the block, ``peak_bytes`` holds the peak and ``peak_gib`` the same in GiB.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._tracker: _StorageTracker | None = None
        self._start = 0

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _StorageTracker(self.device.type)
            self._tracker.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            assert self._tracker is not None
            self._tracker.__exit__(exc_type, exc, tb)
            self.peak_bytes = self._tracker.peak
