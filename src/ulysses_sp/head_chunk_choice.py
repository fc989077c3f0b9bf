"""The decoder layer around a head-chunked attention, as the automatic C sees it at each call.

:meth:`ulysses_sp.head_chunks.HeadChunkedAttention.chunks_for` hands :func:`layer_memory` to the rule the planner
calls too (:func:`ulysses_sp.plan.attention.choose_head_chunks`). It reads the layer as it is when it runs:
checkpointing switched on or off after :func:`ulysses_sp.parallelize` (this library's, transformers' own, or PyTorch's
``checkpoint_wrapper`` put around the layer before or after), FSDP2 wrapping and tiled norms. Where some C fits its
budget, the layer is not read at all (the budget alone chooses).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from .instance_forward import installed_forward
from .norm_projections import NormProjection
from .plan.attention import LayerMemory

__all__ = ["LayerSlot", "layer_memory"]


@dataclass(frozen=True)
class LayerSlot:
    """A decoder ``layer`` and where it sits: ``parent._modules[name]``. The slot is read at each call, since a
    wrapper (PyTorch's ``checkpoint_wrapper``, FSDP2's ``fully_shard`` of it) may be put in it after
    :func:`ulysses_sp.parallelize`; a ``parent`` that is such a wrapper was put there before."""

    layer: nn.Module
    parent: nn.Module | None = None
    name: str = ""

    @staticmethod
    def find(root: nn.Module, layer: nn.Module) -> LayerSlot:
        """``layer``'s slot under ``root`` (no parent where ``layer`` is ``root`` itself)."""
        for parent in root.modules():
            for name, child in parent._modules.items():
                if child is layer:
                    return LayerSlot(layer, parent, name)
        return LayerSlot(layer)

    def holders(self) -> tuple[nn.Module, ...]:
        """The layer and the modules around it that run it: what its slot holds now, and its parent where that is
        an activation wrapper."""
        if self.parent is None:
            return (self.layer,)
        held = self.parent._modules.get(self.name)
        around = (self.parent,) if isinstance(self.parent, ActivationWrapper) else ()
        return (self.layer, *([held] if held is not None and held is not self.layer else []), *around)


def layer_memory(slot: LayerSlot | None, layers: int, query: nn.Module) -> LayerMemory:
    """The decoder layer in ``slot`` (one of ``layers`` whose attention runs in chunks; None: not found, taken as
    checkpointed) around an attention whose query projection is ``query``, as
    :class:`~ulysses_sp.plan.attention.LayerMemory`:

    * checkpointed: the layer checkpoints (its ``gradient_checkpointing`` flag, which
      :func:`ulysses_sp.enable_activation_checkpointing` and transformers' ``gradient_checkpointing_enable`` set, in
      training mode, as transformers' ``GradientCheckpointingLayer`` reads it), PyTorch's activation wrapper
      (``checkpoint_wrapper``, reentrant or not, or ``offload_wrapper``) runs it. Read from the modules only, never
      from grad mode: a reentrant checkpoint runs its forward without a graph and its recompute with one, and the
      two must take the same C (another C draws other attention-dropout masks in the recompute than in the forward
      whose loss they are the gradients of). A checkpoint this cannot see (a hand-written one) reads as not
      checkpointed in both, so both take the same, lower-memory C; under no_grad (evaluation) C is the training one;
    * tiled norms: a tiled norm's projection is installed on ``query`` (:mod:`ulysses_sp.norm_projections`);
    * grad bytes: under FSDP2 (the layer, or the wrapper around it, is an ``FSDPModule``) its trainable parameters'
      unsharded gradients, as many bytes as the unsharded parameters (those the layer runs with: this library's
      FSDP2 casts them to the compute dtype, as the planner counts); 0 otherwise (a replica's are there all step).
    """
    from torch.distributed.fsdp import FSDPModule

    tiled_norms = isinstance(installed_forward(query), NormProjection)
    holders = slot.holders() if slot is not None else ()
    checkpointed = (
        slot is None
        or any(isinstance(m, ActivationWrapper) for m in holders)
        or (bool(getattr(slot.layer, "gradient_checkpointing", False)) and slot.layer.training)
    )
    sharded = any(isinstance(m, FSDPModule) for m in holders)
    params = slot.layer.parameters() if sharded and slot is not None else ()
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return LayerMemory(checkpointed, layers, tiled_norms, grads)
