"""Checkpoint groups: with a stride k > 1 only every k-th decoder layer's input is kept (see
:mod:`ulysses_sp.offload`), and backward rebuilds the inputs of the layers between from it.

:class:`StridedCheckpoint` is the ``_gradient_checkpointing_func`` of each decoder layer then: a group head
keeps its input (on the device, or in the host store in ``"offload"`` mode), the layers after it keep only a
stand-in, and the first one needed in backward has its group's inputs recomputed under ``no_grad`` with the
forward's RNG and autocast state.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .replay import Replay

if TYPE_CHECKING:
    from .offload import HostActivationStore

__all__ = ["StridedCheckpoint", "not_picklable"]


def not_picklable(what: str) -> TypeError:
    """The error of ``pickle`` / ``torch.save`` of a model with activation checkpointing in a state that does
    not pickle; ``what`` completes "cannot pickle a model ..."."""
    return TypeError(
        f"cannot pickle a model {what}. To save the model, save its weights (torch.save(model.state_dict(), path) "
        "or model.save_pretrained(path)), or call ulysses_sp.disable_activation_checkpointing(model) first"
    )


class _Head:
    """A group head's kept input (as the inner hooks packed it) and its group, which lives as long as it."""

    __slots__ = ("group", "packed")

    def __init__(self, packed: Any, group: _Group) -> None:
        self.packed, self.group = packed, group


class _Skipped:
    """Stands for the input of a layer after a group head: recomputed from the head in backward."""

    __slots__ = ("group", "index")

    def __init__(self, group: _Group, index: int) -> None:
        self.group, self.index = group, index


class _Group:
    """One forward's run of ``stride`` layers from a head: each layer's function and forward state, and in
    backward the recomputed inputs not handed out yet."""

    def __init__(self, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.unpack = unpack
        self.head: Any = None
        self.steps: list[tuple[Callable, Replay, nn.Module | None]] = []  # (layer forward, its state, FSDP2 unit)
        self.inputs: dict[int, torch.Tensor] = {}

    def input_of(self, index: int) -> torch.Tensor:
        """The input of layer ``index`` of this group (1 <= index < len(steps)), recomputed on first need."""
        if index not in self.inputs:
            hidden = self.unpack(self.head)  # [b, n, h] on the compute device
            with torch.no_grad():
                for position in range(max(self.inputs, default=0), index):
                    function, replay, unit = self.steps[position]
                    if unit is not None:  # an FSDP2 unit outside its own forward / backward: gather it
                        unit.unshard()
                    with replay():
                        out = function(hidden)
                    if unit is not None:
                        unit.reshard()
                    hidden = out[0] if isinstance(out, tuple) else out
                    self.inputs[position + 1] = hidden
        return self.inputs.pop(index)


class StridedCheckpoint:
    """The ``_gradient_checkpointing_func`` of decoder layer ``index`` with ``stride`` > 1 (module docstring)."""

    def __init__(self, index: int, stride: int, store: HostActivationStore | None, shared: dict, layer: nn.Module):
        self.index, self.stride, self.store, self.shared = index, stride, store, shared
        self.layer = weakref.ref(layer)  # (weak: the layer holds this function)

    def __deepcopy__(self, memo: dict) -> StridedCheckpoint:
        # copy.deepcopy of the model (an EMA or reference copy) copies the layer before its __dict__, so the
        # copied layer is in ``memo``: the copy's function serves it (its FSDP2 unit once sharded, its name in
        # errors), the copy's store, and one fresh group slot shared with the copy's other layers. A function
        # copied on its own serves the same layer.
        layer = self.layer()
        shared = memo.setdefault(id(self.shared), {})
        store = copy.deepcopy(self.store, memo)
        return type(self)(self.index, self.stride, store, shared, memo.get(id(layer), layer))

    def __getstate__(self) -> dict[str, Any]:  # pickle / torch.save: the weak reference to its layer does not pickle
        raise not_picklable("whose decoder layers are checkpointed in groups (checkpoint_stride > 1)")

    def _pack(self, tensor: torch.Tensor) -> Any:
        return self.store.pack(tensor) if self.store is not None else tensor

    def _unpack_head(self, packed: Any) -> torch.Tensor:
        return self.store.unpack_again(packed) if self.store is not None else packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Head):
            packed = packed.packed
        elif isinstance(packed, _Skipped):
            return packed.group.input_of(packed.index)
        return self.store.unpack(packed) if self.store is not None else packed

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(
                f"checkpoint_stride > 1 needs each decoder layer checkpointed as layer(hidden_states, **kwargs); "
                f"{type(self.layer()).__name__} passes {len(args)} positional and {sorted(kwargs)} keyword "
                "arguments; use checkpoint_stride=1"
            )
        if not torch.is_grad_enabled():  # nothing is saved for a backward: no group to keep
            return function(*args)
        position = self.index % self.stride
        group = self.shared.get("group")
        group = group() if group is not None else None
        if position and (group is None or len(group.steps) != position):
            raise ValueError(
                f"decoder layer {self.index} ran without the layers before it in its checkpoint group (stride "
                f"{self.stride}): the layers are not run in order; use checkpoint_stride=1"
            )
        if not position:
            group = _Group(self._unpack_head)
            self.shared["group"] = weakref.ref(group)
        assert group is not None
        layer = self.layer()
        unit = layer if hasattr(layer, "unshard") and hasattr(layer, "reshard") else None  # FSDP2
        group.steps.append((function, Replay(hidden.device), unit))
        key = (hidden.untyped_storage().data_ptr(), hidden.shape)

        def pack(tensor: torch.Tensor) -> Any:
            if (tensor.untyped_storage().data_ptr(), tensor.shape) != key:
                return self._pack(tensor)
            if position:
                return _Skipped(group, position)
            group.head = self._pack(tensor)
            return _Head(group.head, group)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            return checkpoint(function, *args, use_reentrant=False)
