"""Which parts of a ring block pair see each other, cut into rectangles that a fused kernel computes unmasked.

Ring rank ``r`` of ``R`` holds ``n = N / R`` tokens: chunks ``r`` and ``2R - 1 - r`` of ``2R`` chunks of
``c = N / (2R)`` tokens (:func:`ulysses_sp.ring.zigzag_order`), at local positions ``[0, c)`` and ``[c, n)``.
A query sees a key iff both lie in the same document (padding is in none), the key is not after the query,
and (sliding window ``W``) it is less than ``W`` tokens before it. :func:`ring_pieces` lists, for my queries
against the block of ring rank ``source``, the :class:`Piece` rectangles where that holds, each of one kind:

* ``"full"``: every query of the rectangle sees every key;
* ``"causal"``: a square, key ``j`` visible to query ``i`` iff ``j <= i`` (``is_causal`` of the kernels);
* ``"anti"``: a square, key ``j`` visible to query ``i`` iff ``j >= i`` (the lower edge of a window): the
  ring flips rows and keys and runs it as ``"causal"``.

No window: one rectangle per document and block pair. A document's tokens are one contiguous local range
in any block (a document that reaches both chunks of a block covers everything between them), so the
diagonal pair gives a causal square per document, and with zigzag a block before mine is seen through its
first chunk only and a block after mine by my second chunk only: a full rectangle per document. With a
window, each (query chunk, key chunk, document) is cut by :func:`band_pieces` in tiles of ``W`` queries,
about five rectangles per tile; no mask is ever needed, so every kernel stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Piece", "band_pieces", "ring_pieces"]

Range = tuple[int, int, int, int, str]  # (q0, q1, k0, k1, kind)


@dataclass(frozen=True)
class Piece:
    """Queries ``[q0, q1)`` of my block against keys ``[k0, k1)`` of the source block, batch rows ``rows``."""

    rows: slice
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str  # "full" | "causal" | "anti"


def band_pieces(qa: int, qb: int, ka: int, kb: int, window: int | None) -> list[Range]:
    """Queries ``[qa, qb)`` against keys ``[ka, kb)`` (global indices, one document) as disjoint rectangles
    covering exactly the pairs with ``q - window < k <= q`` (``window=None``: ``k <= q``)."""
    if window is not None and qb - 1 - ka < window:
        window = None  # no query of the range is farther than the window from any key
    tile = window if window is not None else qb - qa
    out: list[Range] = []
    for s in range(qa, qb, max(tile, 1)):
        e = min(s + tile, qb)
        # keys inside the tile's own span: causal (a tile spans at most `window` tokens)
        a, b = max(s, ka), min(e, kb)
        if a < b:
            out.append((a, b, a, b, "causal"))
            if b < e:
                out.append((b, e, a, b, "full"))
        # keys before the tile: row q sees keys k >= q - window + 1
        lo, hi = (ka if window is None else max(ka, s - window + 1)), min(kb, s)
        if lo >= hi:
            continue
        full_end = e if window is None else min(e, lo + window)  # rows whose window reaches back to lo
        if s < full_end:
            out.append((s, full_end, lo, hi, "full"))
        if window is None:
            continue
        r0, r1 = max(s, lo + window), min(e, hi + window - 1)  # rows whose window starts inside (lo, hi)
        if r0 < r1:
            k0, m = r0 - window + 1, r1 - r0  # row r0 + i sees keys [k0 + i, hi)
            out.append((r0, r1, k0, k0 + m, "anti"))
            if k0 + m < hi:
                out.append((r0, r1, k0 + m, hi, "full"))
    return out


def _chunks(rank: int, ring: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    # ((local start, global start) of the block's first chunk, the same of its second)
    return (0, rank * chunk), (chunk, (2 * ring - 1 - rank) * chunk)


def _local_range(chunks, chunk: int, start: int, end: int) -> tuple[int, int]:
    """The local positions of the block's tokens in global ``[start, end)``: one range (possibly empty)."""
    found = []
    for local, first in chunks:
        a, b = max(start, first), min(end, first + chunk)
        if a < b:
            found.append((local + a - first, local + b - first))
    if not found:
        return 0, 0
    assert len(found) == 1 or found[0][1] == found[1][0], (found, start, end)  # contiguous (see docstring)
    return found[0][0], found[-1][1]


def _row_pieces(spans, ring: int, rank: int, source: int, chunk: int, window: int | None) -> list[Range]:
    mine, theirs = _chunks(rank, ring, chunk), _chunks(source, ring, chunk)
    out: list[Range] = []
    for start, end in spans:
        if window is not None:  # exact cut per (query chunk, key chunk) in global indices
            for q_local, q_first in mine:
                qa, qb = max(start, q_first), min(end, q_first + chunk)
                for k_local, k_first in theirs:
                    ka, kb = max(start, k_first), min(end, k_first + chunk)
                    if qa < qb and ka < kb:
                        dq, dk = q_local - q_first, k_local - k_first  # global -> local
                        out.extend(
                            (q0 + dq, q1 + dq, k0 + dk, k1 + dk, kind)
                            for q0, q1, k0, k1, kind in band_pieces(qa, qb, ka, kb, window)
                        )
            continue
        q0, q1 = _local_range(mine, chunk, start, end)
        k0, k1 = _local_range(theirs, chunk, start, end)
        if source == rank:
            kind = "causal"
        elif source < rank:  # its second chunk lies after all of my tokens
            k1, kind = min(k1, chunk), "full"
        else:  # only my second chunk lies after its tokens
            q0, kind = max(q0, chunk), "full"
        if q0 < q1 and k0 < k1:
            out.append((q0, q1, k0, k1, kind))
    return out


def ring_pieces(
    spans: list[list[tuple[int, int]]], seq_len: int, ring: int, rank: int, source: int, window: int | None
) -> list[Piece]:
    """The rectangles where my queries (ring rank ``rank``) see the keys of ring rank ``source``.

    ``spans``: per batch row, the ``(start, end)`` of its documents in sequence order
    (:attr:`ulysses_sp.cores.Segments.spans`, padding excluded); ``seq_len`` = N, divisible by ``2 * ring``.
    Rows with the same documents share their pieces (one kernel call for all of them).
    """
    chunk = seq_len // (2 * ring)
    if all(row == spans[0] for row in spans):
        groups = [(slice(None), spans[0])] if spans else []
    else:
        groups = [(slice(row, row + 1), row_spans) for row, row_spans in enumerate(spans)]
    return [
        Piece(rows, *box)
        for rows, row_spans in groups
        for box in _row_pieces(row_spans, ring, rank, source, chunk, window)
    ]
