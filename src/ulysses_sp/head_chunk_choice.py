"""C at run time: what a head-chunked attention knows at its call, handed to the rule the planner calls too.

:func:`chunks_at_call` gives :func:`ulysses_sp.plan.attention.choose_head_chunks` the call's tokens, head dim and
compute dtype, the layout, and the decoder layer around the attention (:func:`layer_memory`), read at every call:
checkpointing switched on or off after :func:`ulysses_sp.parallelize` (this library's or transformers' own), FSDP2
wrapping and tiled norms are seen as they are when the layer runs. Where some C fits its budget, the layer is not
read at all (the budget alone chooses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .instance_forward import installed_forward
from .norm_projections import NormProjection
from .plan.attention import LayerMemory, choose_head_chunks
from .tiling import compute_dtype

if TYPE_CHECKING:
    from .head_chunks import HeadChunkedAttention

__all__ = ["chunks_at_call", "layer_memory"]


def layer_memory(layer: nn.Module | None, layers: int, query: nn.Module, element_size: int) -> LayerMemory:
    """The decoder ``layer`` (one of the model's ``layers``; None: not found, taken as checkpointed) around an
    attention whose query projection is ``query``, as :class:`~ulysses_sp.plan.attention.LayerMemory`:

    * checkpointed: the layer checkpoints (its ``gradient_checkpointing`` flag, which
      :func:`ulysses_sp.enable_activation_checkpointing` and transformers' ``gradient_checkpointing_enable`` set, in
      training mode, as transformers' ``GradientCheckpointingLayer`` reads it), or no graph is recorded (nothing is
      saved for a backward);
    * tiled norms: a tiled norm's projection is installed on ``query`` (:mod:`ulysses_sp.norm_projections`);
    * grad bytes: under FSDP2 (the layer is an ``FSDPModule``) its trainable parameters' unsharded gradients, in the
      compute dtype of ``element_size`` bytes; 0 otherwise (a replica's gradients are there all step).
    """
    from torch.distributed.fsdp import FSDPModule

    if layer is None:
        return LayerMemory(layers=layers, tiled_norms=isinstance(installed_forward(query), NormProjection))
    checkpointed = not torch.is_grad_enabled() or (
        bool(getattr(layer, "gradient_checkpointing", False)) and layer.training
    )
    grads = sum(p.numel() for p in layer.parameters() if p.requires_grad) if isinstance(layer, FSDPModule) else 0
    return LayerMemory(checkpointed, layers, isinstance(installed_forward(query), NormProjection), element_size * grads)


def chunks_at_call(owner: HeadChunkedAttention, x: torch.Tensor) -> int:
    """C for ``owner``'s call on hidden states ``x [b, n, h]`` (this rank's tokens)."""
    layout = owner.ctx.layout
    element_size = torch.empty((), dtype=compute_dtype(x)).element_size()
    query = owner.projection(owner.names.query[0])
    args = (owner.num_heads, owner.num_kv_heads, layout.ulysses)
    return choose_head_chunks(
        *args,
        tokens=x.shape[0] * x.shape[1] * layout.ulysses,
        head_dim=query.out_features // owner.num_heads,
        element_size=element_size,
        hidden=x.shape[-1],
        ring=layout.ring,
        device="cuda" if x.is_cuda else "cpu",
        requested=owner.requested,
        budget_bytes=owner.budget_bytes,
        layer=lambda: layer_memory(owner.layer, owner.layers, query, element_size),
    )
