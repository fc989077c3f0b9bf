"""Which forward pass an attention call belongs to, and so its documents (:class:`~ulysses_sp.cores.Segments`).

The decoder's pre-hook works out each forward pass's Segments once (:meth:`ForwardPasses.add`); every attention
call then finds them by the position_ids tensor its layer receives (:meth:`ForwardPasses.find`). They are put ON
that tensor (the one given to the model, which the layers pass down), so a layer recomputed by activation
checkpointing while another forward pass is alive still finds its own, and ``torch.compile`` reads them without
guarding on the tensor's identity (a table keyed by ``id(position_ids)`` made a compiled layer recompile for every
new tensor, at every step, and run eagerly once dynamo's recompile limit was reached). A table of the passes alive
serves a layer given another tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ForwardPasses"]

_ATTR = "_ulysses_sp_segments"


class _Tag:
    """On a position_ids tensor: whose forward passes (``owner``) it was given to, and that pass's Segments."""

    def __init__(self, owner: ForwardPasses | None, segments: Any) -> None:
        self.owner, self.segments = owner, segments

    def __deepcopy__(self, memo: dict) -> _Tag:
        return _Tag(None, None)  # a copy of the tensor is another tensor: no forward pass was given it

    def __reduce__(self) -> tuple:
        return (_Tag, (None, None))  # saved (torch.save of a shard) without the model's state


class ForwardPasses:
    """The forward passes of one parallelized model that are alive (their position_ids still are)."""

    def __init__(self) -> None:
        # id(position_ids) -> (weak ref to that tensor, its Segments): an entry lives as long as the tensor (held by
        # autograd while the forward may still be recomputed by activation checkpointing)
        self._alive: dict[int, tuple[weakref.ref, Any]] = {}
        self.latest: Any = None

    def add(self, position_ids: torch.Tensor, segments: Any) -> None:
        """A forward pass given ``position_ids`` starts; its documents are ``segments``."""
        key = id(position_ids)
        self._alive[key] = (weakref.ref(position_ids), segments)
        weakref.finalize(position_ids, self._alive.pop, key, None)
        setattr(position_ids, _ATTR, _Tag(self, segments))
        self.latest = segments

    def find(self, position_ids: torch.Tensor | None) -> Any:
        """The Segments of the forward pass that ``position_ids`` (what a layer received) belongs to."""
        if self.latest is None:
            raise RuntimeError(
                "Ulysses attention ran before the model's forward pre-hook: call the parallelized model itself "
                "(not a single layer), or call UlyssesAttention.begin_forward first; or the attention module is a "
                "copy made after parallelize (PEFT's modules_to_save listing an attention module or a decoder layer "
                "deep-copies it): list its projections instead (modules_to_save=['q_proj', 'k_proj', 'v_proj', "
                "'o_proj'])"
            )
        if position_ids is None:  # the model does not hand position_ids to its attention
            return self.latest
        tag = getattr(position_ids, _ATTR, None)
        if tag is not None and tag.owner is self:  # the tensor given to the model
            return tag.segments
        live = list(self._alive.values())
        if len(live) == 1:  # the layer got a derived position_ids tensor, but only one forward is alive
            return live[0][1]
        if not live:  # the model made its own positions (sp == 1 without position_ids)
            return self.latest
        raise RuntimeError(
            "cannot tell which forward pass this attention call belongs to: the layer received a position_ids "
            f"tensor that was not given to the model, while {len(live)} forward passes are alive; pass the "
            "same position_ids tensor down to the attention layers, or finish one backward before the next forward"
        )
