"""The MLP terms of the memory model: a gated MLP's, plain or tiled, or a mixture of experts' (:mod:`.moe`).

Notation as in :mod:`ulysses_sp.plan.memory`; I = the MLP width (:attr:`ModelShape.intermediate_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..features import Features
from ..gated_tile import block_rows
from ..tiling import default_chunk_tokens
from .moe import moe_terms
from .shape import ModelShape

__all__ = ["MlpTerms", "gated_mlp_terms", "mlp_by_layer", "mlp_terms"]


@dataclass(frozen=True)
class MlpTerms:
    """The last decoder layer's MLP, what the other layers' MLPs save, and the MLP of the other kind where layers
    differ (the dense layers of an MoE model)."""

    saved: float  # bytes per local token it saves for backward (0 tiled: only its input, counted with the norm)
    backward: float  # bytes per local token of its backward's working set above that (tiled: or its recompute's)
    grads: float  # bytes of its unsharded parameters' gradients held meanwhile (untiled under FSDP2)
    others_extra: float = 0.0  # bytes per local token the other layers' MLPs save beyond L - 1 times ``saved``
    other_kind: tuple[float, float, float] | None = None  # (saved, backward, grads) of the other kind's MLP
    same_kind: tuple[bool, ...] = ()  # per decoder layer: its MLP is of the last layer's kind


def gated_mlp_terms(
    h: int, inter: int, *, c: int, u: int, t: int, features: Features, fsdp: bool
) -> tuple[float, float, float]:
    """``(saved, backward, grads)`` of a gated MLP ``inter`` wide (see :class:`MlpTerms`)."""
    # Gated MLP: saves 4 [t, I], backward adds 2; tiled: by hand in blocks of r rows (ulysses_sp.gated_tile): 5 [r, I]
    mlp_chunk = min(features.mlp_chunk_tokens or default_chunk_tokens(h), t)
    if features.tiled_mlp:
        mlp_saved, products, block = 0.0, 4 * 3 + (c if c < 4 else 0), block_rows(mlp_chunk)
        mlp_backward = ((5 * c * inter + (u + 4 * c) * h) * block + c * h * mlp_chunk + products * h * inter) / t
        # or its forward, recomputed in this phase: three [c, I] (act and up, then their product), the chunk's norm,
        forward = (3 * c * inter + (u + 2 * c) * h) * mlp_chunk / t + (c * h if mlp_chunk < t else 0) - c * h
        mlp_backward = max(mlp_backward, forward)  # the output buffer of several chunks; no input gradient yet
    else:
        mlp_saved, mlp_backward = 4 * c * inter, 2 * c * inter
    # FSDP2: the MLP's unsharded gradients, made as its backward runs (tiled: inside its own working set, counted there)
    return mlp_saved, mlp_backward, 0 if features.tiled_mlp or not fsdp else c * 3 * h * inter


def mlp_terms(shape: ModelShape, features: Features, *, c: int, u: int, t: int, fsdp: bool) -> MlpTerms:
    """The MLP terms of ``shape``'s last decoder layer for a step of ``t`` tokens on this rank: its gated MLP, or its
    MoE block (:func:`.moe.moe_terms`) with, where some layers are dense, the larger working set of the two kinds."""
    h, moe = shape.hidden_size, shape.moe
    sizes = dict(c=c, u=u, t=t, fsdp=fsdp)
    if moe is None:
        return MlpTerms(*gated_mlp_terms(h, shape.intermediate_size, features=features, **sizes))
    chunk = min(features.mlp_chunk_tokens or default_chunk_tokens(h), t)
    sparse = moe_terms(moe, h=h, chunk=chunk, tiled=features.tiled_mlp, fused_norm=features.tiled_norms, **sizes)
    if all(moe.sparse):
        return MlpTerms(*sparse)
    dense = gated_mlp_terms(h, moe.dense_width, features=features, **sizes)
    last, other = (sparse, dense) if moe.sparse[-1] else (dense, sparse)
    # the other layers: those of the last one's kind but it, and those of the other kind
    same = tuple(kind == moe.sparse[-1] for kind in moe.sparse)
    others = (sum(same) - 1) * last[0] + (len(same) - sum(same)) * other[0]
    return MlpTerms(*last, others - (shape.num_layers - 1) * last[0], other, same)


def mlp_by_layer(phases: dict[str, dict[str, float]], mlp: MlpTerms, t: int) -> None:
    """In place: the MLP backward of each layer of ``phases`` (:mod:`.earlier_layers`' ``"backward: layer i's MLP"``)
    whose MLP is of the other kind (a dense layer of an MoE model) holds that kind's working set and gradients."""
    if mlp.other_kind is None:
        return
    saved, backward, grads = mlp.other_kind
    for layer, same in enumerate(mlp.same_kind):
        phase = phases.get(f"backward: layer {layer}'s MLP")
        if phase is not None and not same:
            phase["mlp"] = (saved + backward) * t
            phase["gradients"] = phase.get("gradients", 0) + grads - mlp.grads
