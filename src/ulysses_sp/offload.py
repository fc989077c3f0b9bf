"""Activation checkpointing per decoder layer, with the kept layer inputs optionally offloaded to host memory.

Modes of :func:`enable_activation_checkpointing`:

* ``"none"``: every layer keeps all its activations for backward (checkpointing off).
* ``"checkpoint"``: each decoder layer keeps only its input ``[b, n, h]``; backward recomputes the layer
  (``torch.utils.checkpoint`` without reentrancy, what transformers' gradient checkpointing runs).
* ``"offload"``: the same, but the kept input lives in host memory. On CUDA the forward copies it
  asynchronously on a side stream into pinned host memory of about its size, reused from step to step
  (:mod:`ulysses_sp.pinned`; the device copy is freed as soon as that copy is done), and in backward the
  input of layer ``i - 1`` (the next one backward recomputes) is copied back on the side stream while layer
  ``i`` still computes. Events order every read after its copy;
  ``record_stream`` keeps the allocator from reusing a device buffer that a pending copy or computation
  still reads. Device memory then holds no per-layer activation between forward and backward: only what
  lies outside the decoder layers (embeddings, final norm, logits and loss) and, in backward, the input
  of the layer being recomputed, plus the prefetched one once it is on its way.

When the copy back starts: in a model parallelized by :func:`ulysses_sp.parallelize` (before this is
enabled, as ``ulysses-sp train`` and the integrations do), once layer ``i``'s attention has finished its
backward (the gradient of its q/k/v projections' outputs is made, :attr:`UlyssesAttention.backward_hooks`),
so the prefetched input is never on the device next to the attention's or the MLP's backward working set,
the layer's peak; it overlaps with the projections' and the input norm's backward. Otherwise (a plain
model) as soon as layer ``i`` starts its recompute, overlapping with all of its backward, one more input
on the device at its peak.

How it plugs in: through transformers' own checkpointing hook. Decoder layers are
``GradientCheckpointingLayer``s that call ``self._gradient_checkpointing_func(forward, *args)`` when
``gradient_checkpointing`` is set and the model is training; ``PreTrainedModel._set_gradient_checkpointing``
sets both on every such module (the one route that accepts our own checkpoint function; the public
``activation_checkpointing_enable`` only passes keyword arguments to ``torch.utils.checkpoint``). The
offload function runs ``torch.utils.checkpoint`` inside ``saved_tensors_hooks``: the checkpoint saves the
layer's positional inputs (``hidden_states``) as saved tensors BEFORE it installs its own hooks, so exactly
those go through the host store, while everything inside the layer stays with the checkpoint. The
flags and functions each module had before are restored by :func:`disable_activation_checkpointing`.

``stride`` k > 1 keeps the input of every k-th decoder layer only (layers 0, k, 2k, ...: the group heads, on
the device or the host as the mode says); the inputs of the k - 1 layers after a head are not kept. In
backward, the first of them that is needed (the group's last) is recomputed by running the group's layers
from the head's input under ``no_grad`` with the forward's RNG and autocast state, keeping the inputs on the
way (at most k - 1 on the device, each freed once its layer has used it); each layer then recomputes itself as
with k = 1. Loss and gradients are unchanged; the cost is one more forward of k - 1 of every k layers, the gain
that only one in k layer inputs is held between forward and backward (host memory / k in offload mode). The
groups are :mod:`ulysses_sp.checkpoint_groups`.

Under torch.compile ``"offload"`` layers run eagerly: dynamo will not trace ``saved_tensors_hooks`` (torch 2.13), and
an eager checkpoint around a compiled layer disables dynamo in everything it calls (``"checkpoint"`` compiles).

On a CPU-only machine the compute device is the host: ``"offload"`` still moves each kept input into the
store's own host copy (one memcpy per layer), so the mechanism runs and can be measured there.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .checkpoint_groups import StridedCheckpoint, not_picklable
from .hf import decoder_layers, find_pretrained
from .pinned import PinnedBuffers

__all__ = [
    "MODES",
    "HostActivationStore",
    "disable_activation_checkpointing",
    "enable_activation_checkpointing",
    "offload_store",
]

MODES = ("none", "checkpoint", "offload")
_STATE_ATTR = "_ulysses_sp_checkpointing"
_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")  # what _set_gradient_checkpointing sets


class _Stored:
    """One kept tensor: its host copy, and (on an accelerator) its way back to the device."""

    __slots__ = ("__weakref__", "arrived", "device", "host", "on_device", "previous")

    def __init__(self, host: torch.Tensor, device: torch.device, previous: _Stored | None) -> None:
        self.host = host
        self.device = device
        self.previous = weakref.ref(previous) if previous is not None else None  # packed just before this one
        self.on_device: torch.Tensor | None = None  # a prefetched device copy, not yet handed out
        self.arrived: torch.cuda.Event | None = None  # recorded on the side stream after the copy back


class HostActivationStore:
    """Saved-tensor hooks that keep tensors in host memory (pinned on CUDA) and prefetch them back.

    ``pack`` runs in forward for each tensor the checkpoint saves; ``unpack`` in backward when the layer's
    recompute needs it, and then schedules the tensor packed just before it (the next layer backward
    will recompute) to be prefetched: at once, or after :meth:`wait_for` when :meth:`fetch_pending` is
    called. Everything lives as long as autograd's graph holds the packed handles.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakSet[_Stored] = weakref.WeakSet()
        self._last: weakref.ref[_Stored] | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: weakref.ref[_Stored] | None = None  # scheduled, waiting for fetch_pending
        self.pinned = PinnedBuffers()  # the kept inputs' host memory on CUDA
        self.late = False  # see wait_for

    def __deepcopy__(self, memo: dict) -> HostActivationStore:
        copied = type(self)()  # a copied model starts with an empty store of its own
        copied.late = self.late
        return copied

    def __getstate__(self) -> dict[str, Any]:  # pickle / torch.save (its weak set and streams do not pickle)
        raise not_picklable("whose activation checkpoints are offloaded to host memory")

    def held_tensors(self) -> list[torch.Tensor]:
        """The host tensors held now (one per kept layer input that autograd still references). On CUDA they are
        views of reused buffers: valid while their inputs are kept (after backward, a later step refills them)."""
        return [entry.host for entry in list(self._live)]

    def held_bytes(self) -> int:
        """Bytes of host storage held now."""
        return sum(t.untyped_storage().nbytes() for t in self.held_tensors())

    def prefetched_bytes(self) -> int:
        """Device bytes of inputs fetched ahead and not handed out yet (0 on a CPU-only machine)."""
        copies = [entry.on_device for entry in list(self._live) if entry.on_device is not None]
        return sum(t.untyped_storage().nbytes() for t in copies)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor) -> _Stored | torch.Tensor:
        if tensor.numel() <= 1:
            # Scalars and the empty placeholder some torch versions save next to each checkpoint's inputs stay
            # as they are: worth nothing to offload, and as entries they would break the prefetch chain
            # (each layer input's ``previous`` must be the layer input packed before it).
            return tensor
        source = tensor.detach()
        if source.device.type == "cuda":
            stream = self._side_stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))  # the tensor has been computed
            nbytes = source.numel() * source.element_size()
            buffer = self.pinned.take(nbytes, source.device)  # page-locked, nbytes or a little more
            host = buffer[:nbytes].view(source.dtype).view(source.shape)
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            buffer, host = None, torch.empty_like(source, device="cpu")
            host.copy_(source)
        previous = self._last() if self._last is not None else None
        entry = _Stored(host, source.device, previous)
        if buffer is not None:  # reused once autograd lets the entry go: every copy in or out is on `stream`
            weakref.finalize(entry, self.pinned.give, buffer).atexit = False
        self._live.add(entry)
        self._last = weakref.ref(entry)
        return entry

    def _fetch(self, entry: _Stored) -> None:
        """Start copying ``entry`` back to its device on the side stream (ordered after its offload)."""
        if entry.on_device is not None or entry.device.type != "cuda":
            return
        stream = self._side_stream(entry.device)
        with torch.cuda.stream(stream):
            entry.on_device = entry.host.to(entry.device, non_blocking=True)
            entry.arrived = torch.cuda.Event()
            entry.arrived.record(stream)

    def _schedule(self, entry: _Stored | None) -> None:
        """``entry`` is needed next: fetch it now, or (after :meth:`wait_for`) when the attention says."""
        if entry is None:
            self._pending = None
            return
        if self.late:
            self._pending = weakref.ref(entry)
        else:
            self._fetch(entry)

    def wait_for(self, attention: Any) -> None:
        """From now on a scheduled fetch waits until a layer's attention has finished its backward: ``attention``
        (a :class:`~ulysses_sp.attention.UlyssesAttention`) calls :meth:`fetch_pending` then."""
        attention.backward_hooks.append(self.fetch_pending)
        self.late = True

    def fetch_pending(self) -> None:
        """Start the fetch scheduled by the last unpack, if any (it is then no longer pending)."""
        entry = self._pending() if self._pending is not None else None
        self._pending = None
        if entry is not None:
            self._fetch(entry)

    def _take(self, entry: _Stored) -> torch.Tensor:
        """``entry``'s tensor on its device: the prefetched copy (fetched now if it is not on its way)."""
        if self._pending is not None and self._pending() is entry:  # needed before its fetch was called for
            self._pending = None
        if entry.device.type == "cpu":
            return entry.host
        if entry.device.type != "cuda":
            return entry.host.to(entry.device)
        self._fetch(entry)
        tensor, entry.on_device = entry.on_device, None
        compute = torch.cuda.current_stream(entry.device)
        compute.wait_event(entry.arrived)  # read only once the copy has arrived
        tensor.record_stream(compute)  # freed only after the compute stream is done with it
        return tensor

    def unpack(self, entry: _Stored | torch.Tensor) -> torch.Tensor:
        """The saved tensor back for the layer recomputing from it; schedules the one packed before it."""
        if isinstance(entry, torch.Tensor):  # kept as it was by pack
            return entry
        tensor = self._take(entry)
        self._schedule(entry.previous() if entry.previous is not None else None)
        return tensor

    def unpack_again(self, entry: _Stored) -> torch.Tensor:
        """A group head's input, to rebuild the inputs of the layers after it (``stride`` > 1); schedules the
        head itself, whose own layer recomputes from it once theirs are done."""
        tensor = self._take(entry)
        self._schedule(entry)
        return tensor


class _OffloadedCheckpoint:
    """A ``_gradient_checkpointing_func``: non-reentrant checkpoint whose kept inputs go to the host store."""

    def __init__(self, store: HostActivationStore) -> None:
        self.store = store

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.store.pack, self.store.unpack):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)


@dataclass
class _State:
    mode: str
    store: HostActivationStore | None
    stride: int
    # (module, the _ATTRS it had in its own __dict__): what a deep copy or pickle keeps, where a sentinel for a
    # missing one (object()) came back as another object, set on the copy's layers by disable
    previous: list[tuple[nn.Module, dict[str, Any]]]


def enable_activation_checkpointing(model: nn.Module, mode: str = "checkpoint", *, stride: int = 1) -> nn.Module:
    """Checkpoint every decoder layer of ``model`` (in place; returns ``model``).

    Args:
        model: a transformers model (or a wrapper around one: PEFT, DDP, ...), before or after FSDP2.
        mode: ``"none"``, ``"checkpoint"`` or ``"offload"`` (see the module docstring). Like transformers'
            own checkpointing it acts while the model is in training mode.
        stride: keep the input of every ``stride``-th decoder layer only and recompute the layers between
            (module docstring); 1 keeps every layer's input.

    Loss and gradients are exactly those without checkpointing. Raises ValueError for an unknown mode, a
    model whose layers do not support checkpointing, or a model already set up by this function.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive int (1 = every layer's input kept), got {stride!r}")
    pretrained = find_pretrained(model, "enable_activation_checkpointing")
    if getattr(pretrained, _STATE_ATTR, None) is not None:
        raise ValueError(
            "activation checkpointing is already set up on this model; call "
            "ulysses_sp.disable_activation_checkpointing(model) first"
        )
    name = type(pretrained).__name__
    if not getattr(pretrained, "supports_gradient_checkpointing", False):
        raise ValueError(f"{name} does not support activation checkpointing (supports_gradient_checkpointing=False)")
    if "value" in inspect.signature(pretrained._set_gradient_checkpointing).parameters:
        raise ValueError(f"{name} uses transformers' pre-4.35 checkpointing hook, which takes no checkpoint function")
    previous = [
        (m, {attr: m.__dict__[attr] for attr in _ATTRS if attr in m.__dict__})
        for m in pretrained.modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    layers = [m for m in decoder_layers(pretrained) if hasattr(m, "gradient_checkpointing")] if stride > 1 else []
    if stride > 1 and mode != "none" and not layers:
        raise ValueError(f"{name} has no checkpointable decoder layers to group by stride {stride}; use stride=1")
    store = HostActivationStore() if mode == "offload" else None
    if store is not None:
        _time_fetches_by_the_attention(pretrained, store)
    if mode == "none":
        pretrained._set_gradient_checkpointing(enable=False)
    else:
        func = _OffloadedCheckpoint(store) if store is not None else functools.partial(checkpoint, use_reentrant=False)
        pretrained._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
        shared: dict = {}  # the group being run by this model's forward (a weak reference)
        for index, layer in enumerate(layers):
            layer._gradient_checkpointing_func = StridedCheckpoint(index, stride, store, shared, layer)
    setattr(pretrained, _STATE_ATTR, _State(mode, store, stride, previous))
    return model


def _attention_contexts(pretrained: nn.Module) -> list[Any]:
    """The :class:`~ulysses_sp.attention.UlyssesAttention` of a parallelized model (none for a plain one)."""
    from .attention import MODULE_ATTR

    found = {id(ctx): ctx for m in pretrained.modules() if (ctx := m.__dict__.get(MODULE_ATTR)) is not None}
    return list(found.values())


def _time_fetches_by_the_attention(pretrained: nn.Module, store: HostActivationStore) -> None:
    """In a parallelized model the store's prefetch waits until a layer's attention has done its backward
    (module docstring)."""
    for ctx in _attention_contexts(pretrained):
        store.wait_for(ctx)


def disable_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_activation_checkpointing`: every module gets back the flag and function it had."""
    pretrained = find_pretrained(model, "disable_activation_checkpointing")
    state: _State | None = getattr(pretrained, _STATE_ATTR, None)
    if state is None:
        return model
    if state.store is not None:
        contexts = _attention_contexts(pretrained)
        for ctx in contexts:
            ctx.backward_hooks[:] = [h for h in ctx.backward_hooks if getattr(h, "__self__", None) is not state.store]
    for module, own in state.previous:
        for attr in _ATTRS:
            module.__dict__.pop(attr, None)
        for attr, value in own.items():
            setattr(module, attr, value)
    delattr(pretrained, _STATE_ATTR)
    return model


def offload_store(model: nn.Module) -> HostActivationStore | None:
    """The host store of a model in ``"offload"`` mode (None otherwise), e.g. to measure what it holds."""
    state: _State | None = getattr(find_pretrained(model, "offload_store"), _STATE_ATTR, None)
    return state.store if state is not None else None
