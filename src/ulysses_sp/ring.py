"""Ring attention with zigzag load balance: the core of the hybrid Ulysses x Ring layout.

Past the head count, Ulysses cannot split further, so ``sp = ulysses x ring``: the Ulysses all-to-all
runs inside groups of ``ulysses`` ranks, and across the ``ring`` groups every rank holds a block of
``N / ring`` tokens for its heads and passes its k/v block around the ring. Each of the ``ring`` steps
attends this rank's queries to the k/v block it holds and merges the result into an accumulator by the
online softmax, kept in fp32 with the log-sum-exp (LSE), so the merge adds no rounding that grows with the
ring size; while it computes, the next k/v block is already on its way (``isend``/``irecv``).

Token order (zigzag). With causal attention and contiguous blocks, ring rank ``i`` would attend ``i + 1``
blocks and the last rank ``ring`` blocks. Instead the sequence is cut into ``2 * ring`` chunks and ring
rank ``i`` holds chunks ``i`` and ``2 * ring - 1 - i`` (:func:`zigzag_order`): against any other rank's
block exactly half of the work is visible (all of my queries to its first chunk when it lies before me;
my second chunk to all of its keys when it lies after me), so every rank does the same work. The
permutation is applied once, by :func:`ulysses_sp.shard_batch` (sp rank ``r`` takes the ``r``-th slice of
the zigzag-ordered row, so the Ulysses all-to-all of a ring rank's ``ulysses`` shards assembles exactly its
two chunks). Tokens, labels, positions and the padding mask move together, and the loss is a sum over
tokens, so nothing else needs to know; :class:`~ulysses_sp.attention.UlyssesAttention` undoes the order on
the gathered positions so that documents are still read from the true sequence.

Block kernels. Documents, padding, causality and a sliding window are never a mask: each block pair is cut
into rectangles that are fully visible or causal (:mod:`ulysses_sp.ring_blocks`), and each rectangle goes
to a fused kernel that returns its LSE (:mod:`ulysses_sp.ring_kernels`: ``cpu_flash`` on CPU, the CUDA
sdpa ops on GPUs, ``plain`` PyTorch as the reference and for softcap), chosen per call (``kernel=``).
Nothing ``O(q x k)`` is held; attention dropout is refused.

Backward is the standard ring backward: k/v travel the ring again, and with them fp32 accumulators of
their gradients, which take one last hop home; each rectangle's gradients come from the kernel's backward
given the FINAL output and LSE of its rows, so the result is exact, and nothing ``O(N^2)`` is kept between
forward and backward. "fp32" here means the accumulation dtype: fp32 for fp32/bf16/fp16 inputs, fp64 for
fp64 inputs.

Bytes per rank and attention layer (``b`` rows, ``hkv`` kv heads per rank after the Ulysses exchange,
``n = N / ring`` tokens per block, ``d`` head dim, ``e`` bytes per element of k/v): forward
``(ring - 1) * 2 * b * hkv * n * d * e``; backward the same for k/v plus ``ring * 2 * b * hkv * n * d * 4``
for the fp32 gradients (see :func:`ring_bytes_per_layer`), all counted as ``"ring_p2p"`` in ``CommStats``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .comm import CommStats
from .cores import Segments, flex_block_mask, packed_kernel
from .ring_blocks import Piece, ring_pieces
from .ring_kernels import acc_dtype, default_ring_kernel, get_ring_kernel

__all__ = [
    "GroupTransport",
    "RingTransport",
    "from_zigzag",
    "merge_partial",
    "ring_attention",
    "ring_bytes_per_layer",
    "zigzag_order",
]

_KV_TAG, _GRAD_TAG = 11, 12


# ---------------------------------------------------------------------------------------------- token order
def zigzag_order(seq_len: int, ring: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[N]`` sequence indices in zigzag order: ring rank ``i``'s ``N / ring`` tokens are chunks ``i`` and
    ``2 * ring - 1 - i`` of ``2 * ring`` equal chunks, and ranks follow one another.

    ``zigzag_order(8, 2) = [0, 1, 6, 7, 2, 3, 4, 5]``. ``seq_len`` must be divisible by ``2 * ring``.
    """
    if seq_len % (2 * ring):
        raise ValueError(f"zigzag order needs a length divisible by 2 x ring = {2 * ring}, got {seq_len}")
    chunks = torch.arange(seq_len, device=device).view(2 * ring, seq_len // (2 * ring))
    pick = [c for i in range(ring) for c in (i, 2 * ring - 1 - i)]
    return chunks[pick].reshape(seq_len)


def from_zigzag(x: torch.Tensor, ring: int, dim: int) -> torch.Tensor:
    """``x`` whose ``dim`` holds a whole sequence in zigzag order (the SP group's shards side by side), back in
    sequence order; ``x`` itself when ``ring == 1``."""
    if ring == 1:
        return x
    return x.index_select(dim, torch.argsort(zigzag_order(x.shape[dim], ring, x.device)))


def ring_bytes_per_layer(
    *, batch: int, kv_heads: int, block_len: int, head_dim: int, ring: int, element_size: int
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per attention layer in the ring (see the module docstring);
    (0, 0) without a ring."""
    if ring == 1:
        return 0, 0
    kv = 2 * batch * kv_heads * block_len * head_dim
    return (ring - 1) * kv * element_size, (ring - 1) * kv * element_size + ring * kv * 4


# ---------------------------------------------------------------------------------------------- merge
def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (give it fp32 tensors).

    out/block_out ``[..., n, d]`` normalised over their own keys, lse/block_lse ``[..., n]``; returns the
    result over the union: ``lse = log(e^lse + e^block_lse)`` and the outputs weighted by
    ``e^(lse_part - lse)``. Rows where both sides saw no key stay (0, -inf).
    """
    new_lse = torch.logaddexp(lse, block_lse)
    base = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))  # -inf rows: exp(-inf) = 0
    merged = out * torch.exp(lse - base)[..., None] + block_out * torch.exp(block_lse - base)[..., None]
    return merged, new_lse


def _merge_into(out: torch.Tensor, lse: torch.Tensor, piece: Piece, part: torch.Tensor, part_lse: torch.Tensor):
    # out [b, h, n, d] / lse [b, h, n] accumulators (fp32); part [b', h, rows, d] / part_lse of the piece's rows.
    # Every row of a piece sees a key (part_lse is finite), so the merged lse is finite too.
    acc, acc_lse = out[piece.rows, :, piece.q0 : piece.q1], lse[piece.rows, :, piece.q0 : piece.q1]
    new_lse = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - new_lse)[..., None]).add_(part * torch.exp(part_lse - new_lse)[..., None])
    acc_lse.copy_(new_lse)


# ---------------------------------------------------------------------------------------------- transport
class RingTransport(Protocol):
    """How k/v blocks and their gradients move to the next ring rank (``rank``/``size`` of the ring)."""

    rank: int
    size: int

    def exchange(self, send: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        """Start sending ``send`` to the next rank and receiving the previous rank's tensor of the same shape;
        the returned function waits for both and gives the received tensor."""
        ...


class GroupTransport:
    """The ring over a process group: ``isend`` to the next rank, ``irecv`` from the previous (None: one rank)."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> None:
        self.group, self.stats = group, stats
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def exchange(self, send: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        recv = torch.empty_like(send)
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = [dist.P2POp(dist.isend, send, nxt, self.group, tag), dist.P2POp(dist.irecv, recv, prv, self.group, tag)]
        works = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.record("ring_p2p", send)

        def wait(send=send) -> torch.Tensor:  # holds `send` until it is out
            for work in works:
                work.wait()
            return recv

        return wait


# ---------------------------------------------------------------------------------------------- the ring
@dataclass
class _Ring:
    """What one call needs: the transport, the kernel, and how my queries see each source block: as
    rectangles (``pieces``) for the rectangle kernels, or as one ``BlockMask`` (``masks``) for ``flex``."""

    transport: RingTransport
    kernel: object
    dtype: torch.dtype  # what the kernel computes in
    scale: float
    softcap: float | None
    pieces: Callable[[int], list[Piece]]  # source ring rank -> rectangles of my queries x its keys
    masks: Callable[[int], object] | None = None  # source ring rank -> flex BlockMask (kernel "flex")

    def forward_step(self, source: int, q, k, v, out, lse) -> None:
        """Merge my queries' attention to ``source``'s k/v into out ``[b, h, n, d]`` / lse ``[b, h, n]`` (fp32)."""
        if self.masks is not None:
            part, part_lse = self.kernel.forward(q, k, v, block_mask=self.masks(source), **self._mods())
            merged, merged_lse = merge_partial(out, lse, part, part_lse)  # rows that see nothing: -inf
            out.copy_(merged)
            lse.copy_(merged_lse)
            return
        for piece in self.pieces(source):
            _merge_into(out, lse, piece, *self._forward_piece(piece, q, k, v))

    def backward_step(self, source: int, grad_out, q, k, v, out, lse, dq, dkv) -> None:
        """Add this block's share to dq ``[b, h, n, d]`` and dkv ``[2, b, hkv, n, d]`` (fp32)."""
        if self.masks is not None:
            grads = self.kernel.backward(grad_out, q, k, v, out, lse, block_mask=self.masks(source), **self._mods())
            dq += grads[0]
            dkv[0] += grads[1]
            dkv[1] += grads[2]
            return
        for piece in self.pieces(source):
            dq_part, dk_part, dv_part = self._backward_piece(piece, grad_out, q, k, v, out, lse)
            dq[piece.rows, :, piece.q0 : piece.q1] += dq_part
            dkv[0][piece.rows, :, piece.k0 : piece.k1] += dk_part
            dkv[1][piece.rows, :, piece.k0 : piece.k1] += dv_part

    def _mods(self) -> dict:
        return {"scale": self.scale, "softcap": self.softcap}

    def _forward_piece(self, piece: Piece, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (x[piece.rows, :, lo:hi] for x, lo, hi in _spans(piece, q, k, v))
        if piece.kind == "anti":  # keys at or after the query: reversed, that is causal
            q, k, v = q.flip(2), k.flip(2), v.flip(2)
        out, lse = self.kernel.forward(q, k, v, causal=piece.kind != "full", **self._mods())
        return (out.flip(2), lse.flip(-1)) if piece.kind == "anti" else (out, lse)

    def _backward_piece(self, piece: Piece, grad_out, q, k, v, out, lse):
        rows = slice(piece.q0, piece.q1)
        q, k, v = (x[piece.rows, :, lo:hi] for x, lo, hi in _spans(piece, q, k, v))
        grad_out, out, lse = grad_out[piece.rows, :, rows], out[piece.rows, :, rows], lse[piece.rows, :, rows]
        flip = piece.kind == "anti"
        if flip:
            q, k, v, grad_out, out, lse = q.flip(2), k.flip(2), v.flip(2), grad_out.flip(2), out.flip(2), lse.flip(-1)
        grads = self.kernel.backward(grad_out, q, k, v, out, lse, causal=piece.kind != "full", **self._mods())
        return tuple(g.flip(2) for g in grads) if flip else grads


def _spans(piece: Piece, q, k, v):
    return ((q, piece.q0, piece.q1), (k, piece.k0, piece.k1), (v, piece.k0, piece.k1))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):  # type: ignore[override]
        # q [b, h, n, d]; k/v [b, hkv, n, d] -> out [b, h, n, d] in q's dtype
        (b, h, n, d), acc = q.shape, acc_dtype(q.dtype)
        out = torch.zeros(b, h, n, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)  # -inf: padding rows
        transport, qc = ring.transport, q.to(ring.dtype)
        kv = torch.stack([k, v])  # [2, b, hkv, n, d]: one message per step
        for step in range(transport.size):
            source = (transport.rank - step) % transport.size
            pending = transport.exchange(kv, _KV_TAG) if step < transport.size - 1 else None
            kvc = kv.to(ring.dtype)
            ring.forward_step(source, qc, kvc[0], kvc[1], out, lse)
            if pending is not None:  # waits for the send too, before the sent block may be freed
                kv = pending()
        result = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        transport, acc = ring.transport, acc_dtype(q.dtype)
        qc, grad_c, out_c = (x.to(ring.dtype) for x in (q, grad_out, out))
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv, grad_pending = None, None  # fp32 [2, b, hkv, n, d], travelling with the k/v block it belongs to
        for step in range(transport.size):
            source = (transport.rank - step) % transport.size
            kv_pending = transport.exchange(kv, _KV_TAG) if step < transport.size - 1 else None
            kvc = kv.to(ring.dtype)
            step_dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # this step's share of dk/dv
            ring.backward_step(source, grad_c, qc, kvc[0], kvc[1], out_c, lse, dq, step_dkv)
            # the block's gradient so far, from the ranks it visited before me
            dkv = step_dkv if grad_pending is None else grad_pending().add_(step_dkv)
            if transport.size > 1:  # to the next rank; after the last step that is the block's home
                grad_pending = transport.exchange(dkv, _GRAD_TAG)
            if kv_pending is not None:
                kv = kv_pending()
        if grad_pending is not None:  # my own block's gradient, home from its last rank
            dkv = grad_pending()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _flex_mask(segments: Segments, ring: int, rank: int, source: int, window: int | None, device: torch.device):
    """The ``BlockMask`` of my zigzag block's queries against ``source``'s keys: same document, not after the
    query, inside the window (global indices), built once per forward pass."""
    n = segments.seq_len // ring
    order = zigzag_order(segments.seq_len, ring, device).view(ring, n)
    mine, theirs = order[rank], order[source]  # [n] sequence index of each local token
    docs = segments.doc_ids().to(device)  # [b, N], -1 for padding
    q_docs, k_docs = docs[:, mine], docs[:, theirs]  # [b, n]

    def mask_mod(b, h, qi, kj):
        keep = (q_docs[b, qi] == k_docs[b, kj]) & (q_docs[b, qi] >= 0) & (theirs[kj] <= mine[qi])
        if window is not None:
            keep = keep & (theirs[kj] > mine[qi] - window)
        return keep

    return flex_block_mask(mask_mod, segments.batch, n, n, device)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    group: dist.ProcessGroup | RingTransport | None,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    stats: CommStats | None = None,
    query_chunk: int | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact causal attention of this ring rank's zigzag block against the whole sequence.

    q ``[b, h, n, d]``, k/v ``[b, hkv, n, d]`` with ``n = N / ring`` the tokens of this rank's two chunks
    (:func:`zigzag_order`), ``segments`` the documents and padding of the full rows ``[b, N]`` in sequence
    order -> ``[b, n, h, d]`` (the layout the local cores return). ``group``: the ring's process group (None:
    one rank), or any :class:`RingTransport`. Padding queries get a zero output. ``kernel``: a name of
    :data:`~ulysses_sp.ring_kernels.RING_KERNELS` (default: the device's fused kernel, ``plain`` for softcap
    where it has none); ``query_chunk``: queries per computation of the ``plain`` kernel (default: scores of
    at most 2^24 elements).
    """
    if dropout:
        raise ValueError(f"ring attention has no attention dropout (dropout={dropout}); set attention_dropout=0")
    if group is None or isinstance(group, dist.ProcessGroup):
        transport: RingTransport = GroupTransport(group, stats)
    else:
        transport = group
    size, rank = transport.size, transport.rank
    if q.shape[2] * size != segments.seq_len or segments.seq_len % (2 * size):
        raise ValueError(
            f"ring attention got {q.shape[2]} tokens per rank on {size} ranks for rows of {segments.seq_len} "
            f"tokens; the rows must be sharded by ulysses_sp.shard_batch (zigzag order, length divisible by "
            f"2 x ring)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    many_documents = packed_kernel(segments, q.device, q.shape[-1]) == "flex"  # the sdpa core's own test
    name = kernel or default_ring_kernel(q.device, q.dtype, q.shape[-1], softcap, many_documents)
    block_kernel = get_ring_kernel(name, query_chunk=query_chunk)
    if softcap is not None and not block_kernel.supports_softcap:
        raise ValueError(f"ring kernel {name!r} cannot apply softcap={softcap}; use kernel='plain'")

    def pieces(source: int) -> list[Piece]:
        key = ("ring_pieces", size, rank, source, sliding_window)
        return segments.cached(  # type: ignore[return-value]
            key, lambda: ring_pieces(segments.spans, segments.seq_len, size, rank, source, sliding_window)
        )

    def masks(source: int) -> object:
        key = ("ring_flex", size, rank, source, sliding_window, str(q.device))
        return segments.cached(key, lambda: _flex_mask(segments, size, rank, source, sliding_window, q.device))

    ring = _Ring(
        transport=transport,
        kernel=block_kernel,
        dtype=block_kernel.compute_dtype(q.dtype),
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        softcap=softcap,
        pieces=pieces,
        masks=masks if name == "flex" else None,
    )
    return _RingAttention.apply(q, k, v, ring).transpose(1, 2)
