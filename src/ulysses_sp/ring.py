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
the gathered positions so that documents are still read from the true sequence. Doing the balance inside
the core instead would cost an extra exchange of queries in every layer.

Masking uses global sequence indices: a key is visible to a query iff it is in the same document (from
:class:`~ulysses_sp.cores.Segments`, which also marks padding), it is not after the query, and (with a
sliding window ``W``) it is less than ``W`` tokens before it. Softcapping is supported; attention dropout
is refused.

Backward is the standard ring backward: k/v travel the ring again, and with them fp32 accumulators of
their gradients, which take one last hop home; the softmax is recomputed per block from the saved LSE, so
the result is exact (no approximation), and nothing ``O(N^2)`` is kept between forward and backward.
"fp32" here means the accumulation dtype: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 inputs.

The block kernel here is plain PyTorch (it materialises the ``[q, k]`` scores of one block in fp32): the
reference path, correct on any device; a fused kernel returning the LSE can replace :func:`block_forward`
/ :func:`block_backward` without touching the ring.

Bytes per rank and attention layer (``b`` rows, ``hkv`` kv heads per rank after the Ulysses exchange,
``n = N / ring`` tokens per block, ``d`` head dim, ``e`` bytes per element of k/v): forward
``(ring - 1) * 2 * b * hkv * n * d * e``; backward the same for k/v plus ``ring * 2 * b * hkv * n * d * 4``
for the fp32 gradients (see :func:`ring_bytes_per_layer`), all counted as ``"ring_p2p"`` in ``CommStats``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import CommStats
from .cores import Segments

__all__ = [
    "block_backward",
    "block_forward",
    "merge_partial",
    "ring_attention",
    "ring_bytes_per_layer",
    "zigzag_order",
]

_KV_TAG, _GRAD_TAG = 11, 12
_SCORES_BUDGET = 1 << 24  # elements of one [b, h, chunk, n] score tensor


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


def ring_bytes_per_layer(
    *, batch: int, kv_heads: int, block_len: int, head_dim: int, ring: int, element_size: int
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per attention layer in the ring (see the module docstring);
    (0, 0) without a ring."""
    if ring == 1:
        return 0, 0
    kv = 2 * batch * kv_heads * block_len * head_dim
    return (ring - 1) * kv * element_size, (ring - 1) * kv * element_size + ring * kv * 4


# ---------------------------------------------------------------------------------------------- block math
def _acc(x: torch.Tensor) -> torch.dtype:
    # the accumulation dtype: fp32 for 16-bit inputs, else the input's own (fp64 stays fp64)
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None):
    # q [b, hkv, g, nq, d], k [b, hkv, nk, d] -> fp32 scores [b, hkv, g, nq, nk] (and tanh for softcap)
    acc = _acc(q)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q.to(acc), k.to(acc)) * scale
    if softcap is None:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, capped


def _group(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # [b, h, n, d] -> [b, hkv, h/hkv, n, d]: query heads grouped by the kv head they read (GQA)
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[b, h, nq, d]`` to k/v ``[b, hkv, nk, d]`` where ``visible`` ``[b, nq, nk]``.

    Returns ``(out [b, h, nq, d], lse [b, h, nq])`` in fp32 (fp64 for fp64 inputs); a query that sees no
    key gets out 0 and lse ``-inf``.
    """
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    scores, _ = _scores(_group(q, hkv), k, scale, softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, hkv, g, nq]
    probs = torch.exp(scores - _finite(lse)[..., None])
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.to(probs.dtype))
    return out.reshape(b, h, nq, d), lse.reshape(b, h, nq)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL lse and ``delta = sum(grad_out * out, -1)`` of the rows.

    q/grad_out ``[b, h, nq, d]``, lse/delta ``[b, h, nq]``, k/v ``[b, hkv, nk, d]`` -> (dq, dk, dv) in fp32
    (fp64 for fp64 inputs).
    """
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    qg = _group(q, hkv)
    scores, capped = _scores(qg, k, scale, softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.exp(scores - _finite(_group(lse[..., None], hkv)))  # [b, hkv, g, nq, nk]
    acc = probs.dtype
    dout = _group(grad_out, hkv).to(acc)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, dout)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout, v.to(acc))
    dscores = probs * (dprobs - _group(delta[..., None], hkv).to(acc))
    if capped is not None:
        dscores = dscores * (1 - capped * capped)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k.to(acc)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg.to(acc)) * scale
    return dq.reshape(b, h, nq, d), dk, dv


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (give it fp32 tensors).

    out/block_out ``[..., n, d]`` normalised over their own keys, lse/block_lse ``[..., n]``; returns the
    result over the union: ``lse = log(e^lse + e^block_lse)`` and the outputs weighted by
    ``e^(lse_part - lse)``. Rows where both sides saw no key stay (0, -inf).
    """
    new_lse = torch.logaddexp(lse, block_lse)
    base = _finite(new_lse)
    merged = out * torch.exp(lse - base)[..., None] + block_out * torch.exp(block_lse - base)[..., None]
    return merged, new_lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # -inf (a row that sees no key) -> 0, so exp(-inf - 0) = 0 instead of exp(nan)
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


# ---------------------------------------------------------------------------------------------- the ring
@dataclass
class _Ring:
    """What one call needs to know about its ring and the tokens of every ring rank."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    docs: torch.Tensor  # [R, b, n] document id of each token of each ring rank's block (-1 = padding)
    index: torch.Tensor  # [R, n] sequence index of each token of each ring rank's block
    scale: float
    softcap: float | None
    window: int | None
    stats: CommStats | None
    query_chunk: int  # queries per block computation: bounds the [b, h, chunk, n] scores

    def peers(self) -> tuple[int, int]:
        """(next, previous) ring rank as global ranks."""
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return dist.get_global_rank(self.group, nxt), dist.get_global_rank(self.group, prv)

    def blocks(self, source: int) -> Iterator[tuple[slice, slice, torch.Tensor]]:
        """(query rows, key columns, visible [b, rows, cols]) of my queries against ``source``'s block,
        in chunks of at most ``query_chunk`` rows.

        Zigzag: a block before mine is visible only through its first chunk; for a block after mine only
        my second chunk sees anything (see the module docstring). Documents, causality and the window
        are then applied from the global indices.
        """
        n = self.index.shape[1]
        half = n // 2
        cols = slice(None, half) if source < self.rank else slice(None)
        kj, kd = self.index[source, cols], self.docs[source][:, cols]
        for start in range(half if source > self.rank else 0, n, self.query_chunk):
            rows = slice(start, min(start + self.query_chunk, n))
            qi, qd = self.index[self.rank, rows], self.docs[self.rank][:, rows]
            visible = (qd[:, :, None] == kd[:, None, :]) & (qd >= 0)[:, :, None]
            visible &= (kj[None, :] <= qi[:, None])[None]
            if self.window is not None:
                visible &= (kj[None, :] > qi[:, None] - self.window)[None]
            yield rows, cols, visible

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Send ``send`` to the next rank and receive the previous rank's tensor of the same shape."""
        recv = torch.empty_like(send)
        nxt, prv = self.peers()
        ops = [dist.P2POp(dist.isend, send, nxt, self.group, tag), dist.P2POp(dist.irecv, recv, prv, self.group, tag)]
        works = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.record("ring_p2p", send)
        return recv, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):  # type: ignore[override]
        # q [b, h, n, d]; k/v [b, hkv, n, d] -> out [b, h, n, d] in q's dtype
        b, h, n, d = q.shape
        out = torch.zeros(b, h, n, d, dtype=_acc(q), device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=_acc(q), device=q.device)
        kv = torch.stack([k, v]).contiguous()  # [2, b, hkv, n, d]: one message per step
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            pending = ring.exchange(kv, _KV_TAG) if step < ring.size - 1 else None
            for rows, cols, visible in ring.blocks(source):
                block_out, block_lse = block_forward(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], visible, scale=ring.scale, softcap=ring.softcap
                )
                out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:  # wait (for the send too) before the sent block may be freed
                recv, works = pending
                _wait(works)
                kv = recv
        result = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        acc = _acc(q)
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [b, h, n]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv, grad_pending = None, None  # fp32 [2, b, hkv, n, d], travelling with the k/v block it belongs to
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            kv_pending = ring.exchange(kv, _KV_TAG) if step < ring.size - 1 else None
            step_dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # this step's share of dk/dv
            for rows, cols, visible in ring.blocks(source):
                dq_block, dk_block, dv_block = block_backward(
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    grad_out[:, :, rows],
                    lse[:, :, rows],
                    delta[:, :, rows],
                    visible,
                    scale=ring.scale,
                    softcap=ring.softcap,
                )
                dq[:, :, rows] += dq_block
                step_dkv[0][:, :, cols] += dk_block
                step_dkv[1][:, :, cols] += dv_block
            if grad_pending is None:
                dkv = step_dkv
            else:  # the block's gradient so far, from the ranks it visited before me
                recv, works = grad_pending
                _wait(works)
                dkv = recv + step_dkv
            if ring.size > 1:  # to the next rank; after the last step that is the block's home
                grad_pending = ring.exchange(dkv, _GRAD_TAG)
            if kv_pending is not None:
                recv, works = kv_pending
                _wait(works)
                kv = recv
        if grad_pending is not None:  # my own block's gradient, home from its last rank
            recv, works = grad_pending
            _wait(works)
            dkv = recv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _ring_tokens(segments: Segments, ring: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # (docs [R, b, n], index [R, n]) of every ring rank's zigzag block, once per forward pass
    def build():
        order = zigzag_order(segments.seq_len, ring, device)
        docs = segments.doc_ids().to(device).index_select(1, order)  # [b, N] in zigzag order
        n = segments.seq_len // ring
        return docs.view(segments.batch, ring, n).transpose(0, 1), order.view(ring, n)

    return segments.cached(("ring", ring, str(device)), build)  # type: ignore[return-value]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    group: dist.ProcessGroup | None,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    stats: CommStats | None = None,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Exact causal attention of this ring rank's zigzag block against the whole sequence.

    q ``[b, h, n, d]``, k/v ``[b, hkv, n, d]`` with ``n = N / ring`` the tokens of this rank's two chunks
    (:func:`zigzag_order`), ``segments`` the documents and padding of the full rows ``[b, N]`` in sequence
    order -> ``[b, n, h, d]`` (the layout the local cores return). With one rank (or no group) it is
    plain blockwise attention over the block. Padding queries get a zero output. ``query_chunk``: queries
    per block computation (default: as many as keep the fp32 scores of one computation under 2^24
    elements, 64 MiB).
    """
    if dropout:
        raise ValueError(f"ring attention has no attention dropout (dropout={dropout}); set attention_dropout=0")
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if q.shape[2] * size != segments.seq_len or segments.seq_len % (2 * size):
        raise ValueError(
            f"ring attention got {q.shape[2]} tokens per rank on {size} ranks for rows of {segments.seq_len} "
            f"tokens; the rows must be sharded by ulysses_sp.shard_batch (zigzag order, length divisible by "
            f"2 x ring)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    docs, index = _ring_tokens(segments, size, q.device)
    ring = _Ring(
        group=group,
        rank=rank,
        size=size,
        docs=docs,
        index=index,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        softcap=softcap,
        window=sliding_window,
        stats=stats,
        query_chunk=query_chunk or max(1, _SCORES_BUDGET // (q.shape[0] * q.shape[1] * q.shape[2])),
    )
    return _RingAttention.apply(q, k, v, ring).transpose(1, 2)
