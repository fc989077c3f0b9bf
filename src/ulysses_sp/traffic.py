"""Bytes per attention layer and rank from the shapes: the Ulysses exchange and ring attention (the planner
reports them; the benchmark checks its measured counts against them).

``b`` rows, ``N`` tokens, ``P`` ranks, ``n = N / P``, ``H`` / ``Hkv`` query / kv heads, ``d`` head dim,
``e`` bytes per element. Bytes are what one rank hands to the collectives (the whole send buffer).
"""

from __future__ import annotations

from .head_split import ChunkHeads
from .ring import ring_bytes_per_layer

__all__ = ["ring_p2p_per_layer", "ulysses_bytes_per_layer"]


def ulysses_bytes_per_layer(
    *,
    batch: int,
    seq_len: int,
    sp: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    chunks: int = 1,
    fused: bool = True,
) -> int:
    """Forward + backward all-to-all bytes of one Ulysses attention layer on one rank (no recompute).

    q/k/v out: ``b n d (H + 2 hkv P)`` elements with ``hkv = max(Hkv / P, 1)`` kv heads per destination;
    attention output back: ``b n H d``; the backward sends the same again (gradients).

    With the heads in ``chunks`` > 1 (:mod:`ulysses_sp.head_chunk_pipeline`) each chunk sends its q/k/v
    (``b n d (Hc + 2 hkv_c P)``, ``hkv_c = max(Hkv_c / P, 1)`` for the ``Hkv_c`` kv heads its query heads read)
    and its output forward; in backward the q/k/v again, the output's gradient with the output's row sums
    (``b n Hc`` more elements; ``fused``: the chunk's core runs through a block kernel, :mod:`ulysses_sp.chunk_core`)
    or with the output itself (not ``fused``: the core recomputed), and the q/k/v gradients. Where the chunks share
    the kv heads (``Hkv_c < P``, :attr:`~ulysses_sp.head_split.ChunkHeads.shared_kv`) the kv heads go once each
    way, as without chunks (and again in backward), and each chunk sends its q.
    """
    if sp == 1:
        return 0
    n = seq_len // sp
    split = ChunkHeads(heads, kv_heads, chunks, sp)
    if chunks == 1 or split.shared_kv:  # one forward's worth of the whole layer's q/k/v and output
        sends, query, hkv = 1, heads, max(kv_heads // sp, 1)
    else:  # per chunk
        sends, query, hkv = chunks, split.heads_per_chunk, max(split.kv_per_chunk // sp, 1)
    qkv, out = batch * n * head_dim * (query + 2 * hkv * sp), batch * n * query * head_dim
    if chunks == 1:
        return 2 * (qkv + out) * element_size
    backward = 2 * qkv + out + (batch * n * query if fused else out)
    return sends * (qkv + out + backward) * element_size


def ring_p2p_per_layer(
    *, batch: int, seq_len: int, ring: int, kv_heads: int, head_dim: int, element_size: int
) -> dict[str, int]:
    """Ring attention over ``ring`` ranks (each holds ``N / ring`` tokens, all kv heads), one layer, one rank.

    Forward: ``ring - 1`` sends, each passing this rank's current k and v block on (``2 b Hkv n d``
    elements). Backward (the usual ring backward): k/v travel again (``ring - 1`` sends) and their fp32
    gradient accumulators travel ``ring`` hops (``ring`` sends). Bytes: :func:`ulysses_sp.ring.ring_bytes_per_layer`.
    """
    forward, backward = ring_bytes_per_layer(
        batch=batch,
        kv_heads=kv_heads,
        block_len=seq_len // ring,
        head_dim=head_dim,
        ring=ring,
        element_size=element_size,
    )
    sends = ring > 1
    return {
        "forward_bytes": forward,
        "backward_bytes": backward,
        "forward_sends": (ring - 1) * sends,
        "backward_sends": (2 * ring - 1) * sends,
    }
