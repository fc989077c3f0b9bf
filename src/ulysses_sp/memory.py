"""Measure the peak memory that a piece of code allocates, on CUDA and on the CPU alike.

``with PeakMemory(device) as peak: ...`` then ``peak.peak_bytes`` is the highest number of bytes held by
tensors that were allocated inside the block, above what was allocated when it began (the block's "extra"
memory, the quantity a memory plan predicts).

* CUDA: the caching allocator's own counters (``torch.cuda.max_memory_allocated``), reset on entry.
* CPU: PyTorch keeps no allocation counters for the CPU, so a :class:`TorchDispatchMode` sees the output of
  every operator (forward and backward), records each storage once (views share their base's storage) and
  subtracts it when the storage is freed. Storages that already existed when the block began (the weights,
  the optimizer states: every tensor the garbage collector can reach then) count only by what they grow
  inside it, and those are re-read after every operator: FSDP2 allocates and frees its unsharded
  parameters by resizing such storages in place, which no operator reports (so measure FSDP2 from its
  second step on: the first creates those storages inside the block). It counts tensor storages, not
  allocator slack or kernels' internal scratch space. It slows every operator a little, so use it for
  measurements, not in training. (The profiler's CPU memory events are not used instead: a free that
  happens on another thread, e.g. gloo's, is missing from them, so their running sum drifts upward.)
"""

from __future__ import annotations

import gc
import threading
import weakref
from types import TracebackType

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory", "SavedActivations"]


class _StorageTracker(TorchDispatchMode):
    """Live bytes of the storages that operators inside the mode create or grow, and their peak.

    ``live`` maps each counted storage (by its ``data_ptr`` when last seen) to the bytes it counts for.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._counted: dict[int, tuple[int, int]] = {}  # storage id -> (data_ptr, bytes counted)
        self._baseline: dict[int, int] = {}  # storage id -> bytes it had when the mode was entered
        # older storages seen inside, re-read after each operator; held weakly so that they can still be freed
        self._resizable: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # a storage may be freed on another thread (gloo's, the autograd engine's); re-entrant, since a garbage
        # collection that runs while this thread holds it (an allocation inside _count) calls _free on this thread
        self._lock = threading.RLock()

    @property
    def live(self) -> dict[int, int]:
        return {ptr: nbytes for ptr, nbytes in self._counted.values() if nbytes}

    def __enter__(self) -> _StorageTracker:
        # Garbage left by earlier code goes first: freed inside the block, its finalizers could run operators
        # (counted as this block's) and its storages' addresses could be reused by new ones.
        gc.collect()
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # not isinstance: it reads __class__, which warns on some
                # deprecated torch objects. A leaf's .grad may have no Python object of its own (so the
                # collector cannot see it) until it is read; backward then accumulates into it in place.
                grad = obj.grad if obj.is_leaf and obj.requires_grad else None
                for tensor in (obj,) if grad is None else (obj, grad):
                    for storage in self._storages(tensor):
                        self._baseline[storage._cdata] = storage.nbytes()
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        self._resizable.clear()

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._counted.pop(key, None)
            self._resizable.pop(key, None)
            self._baseline.pop(key, None)  # a new storage may come to live at the same address
            if entry is not None:
                self.current -= entry[1]

    def _count(self, key: int, storage: torch.UntypedStorage) -> None:
        with self._lock:
            nbytes = max(0, storage.nbytes() - self._baseline.get(key, 0))
            ptr, counted = self._counted.get(key, (0, 0))
            self._counted[key] = (storage.data_ptr(), nbytes)
            self.current += nbytes - counted
            self.peak = max(self.peak, self.current)

    def _storages(self, tensor: torch.Tensor) -> list[torch.UntypedStorage]:
        """The storages on the tracked device that hold ``tensor``'s data."""
        return [
            local.untyped_storage()
            for local in _local_tensors(tensor)
            if local.device.type == self.device_type and not local.is_meta
        ]

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        for storage in self._storages(tensor):
            key = storage._cdata
            if key in self._counted:
                continue
            weakref.finalize(storage, self._free, key)
            if key in inputs:  # not made by this operator: maybe resized in place later
                self._resizable[key] = weakref.ref(storage)
            else:  # made by it, maybe where an older storage lived
                self._baseline.pop(key, None)
            self._count(key, storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for key, ref in list(self._resizable.items()):  # resized in place since the last operator?
            storage = ref()
            if storage is not None:
                self._count(key, storage)
        outputs = [item for item in tree_flatten(out)[0] if isinstance(item, torch.Tensor)]
        if outputs:
            inputs = {
                storage._cdata
                for item in tree_flatten((args, kwargs))[0]
                if isinstance(item, torch.Tensor)
                for storage in self._storages(item)
            }
            for item in outputs:
                self._track(item, inputs)
        return out


def _local_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data (the local tensors a DTensor wraps)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    inner = (getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
    return [t for item in inner if isinstance(item, torch.Tensor) for t in _local_tensors(item)]


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


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = ...`` then ``saved.bytes``: what backward will read.

    Counts every tensor autograd saves inside the block, one storage once, leaving out the storages of
    ``model``'s parameters (weights are not activations; a cast copy of a weight, e.g. under autocast, is
    counted because it is allocated for this step), and those of ``inputs`` (tensors made before the block).
    """

    def __init__(self, model: nn.Module | None = None, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        params = [t for p in model.parameters() for t in _local_tensors(p)] if model is not None else []
        self._params = {t.untyped_storage().data_ptr() for t in [*params, *inputs]}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._params and key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
