"""Differentiable collectives for Ulysses: the two all-to-alls, plus the small reductions around them.

Every collective here short-circuits when its group has one rank (or no group), so sp=1 runs in one
process with no process group, and every call is counted in a :class:`CommStats` when one is given, so
benchmarks and tests can read collectives and bytes per step.

Shapes: P = sp, N = full sequence, n = N / P local tokens, H / Hkv = query / key-value heads, d = head dim.

* :func:`qkv_seq_to_heads`: q ``[b, H, n, d]``, k/v ``[b, Hkv, n, d]`` -> q ``[b, H/P, N, d]``,
  k/v ``[b, hkv, N, d]`` with ``hkv = Hkv/P`` (or 1 when ``Hkv < P``), in ONE all-to-all.
* :func:`heads_to_seq`: out ``[b, N, H/P, d]`` -> ``[b, n, H, d]``, one all-to-all.

The backward of an all-to-all with equal splits is the same all-to-all applied to the gradient, so each
exchange costs one collective forward and one backward.

The buffer layouts of the two exchanges (and their adjoints, for a backward written by hand) are plain functions
(``qkv_send_buffer`` ... ``out_send_grad``), and :func:`start_all_to_all` launches one exchange without waiting,
so the head-chunked attention (:mod:`ulysses_sp.head_chunks`) can keep one chunk's exchange in flight while
another chunk computes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "Joined",
    "all_gather_tensor",
    "all_reduce_sum",
    "all_to_all",
    "heads_to_seq",
    "out_local",
    "out_local_grad",
    "out_pack_send",
    "out_send_buffer",
    "out_send_grad",
    "qkv_full",
    "qkv_full_grad",
    "qkv_send_buffer",
    "qkv_send_grad",
    "qkv_send_parts",
    "qkv_seq_to_heads",
    "start_all_to_all",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class CommStats:
    """Counts of collectives and bytes sent by this rank, keyed by operation name.

    ``calls["all_to_all"]`` counts forward and backward exchanges alike; ``bytes`` is the payload this
    rank hands to the collective (for an all-to-all: the whole send buffer, of which ``1/P`` stays local).
    Collectives traced by ``torch.compile`` are not counted: a count kept inside a graph makes dynamo guard
    on its value (a recompile at every step) and break the graph at every exchange.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    wait_s: float = 0.0  # host seconds blocked on asynchronous exchanges (head chunks): the part not overlapped

    def record(self, op: str, tensor: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.wait_s = 0.0


# ---------------------------------------------------------------------------------------------- all-to-all
def _all_to_all_raw(x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
    # x: [P, ...] -> out: [P, ...]; chunk j of x goes to rank j, chunk j of out came from rank j.
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.record("all_to_all", x)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):  # type: ignore[override]
        ctx.group, ctx.stats = group, stats
        return _all_to_all_raw(x, group, stats)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_to_all_raw(grad, ctx.group, ctx.stats), None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable all-to-all over dim 0: ``x[j]`` goes to rank ``j``; ``out[j]`` came from rank ``j``.

    ``x.shape[0]`` must equal the group size. Identity when the group has one rank.
    """
    if _group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, stats)


def start_all_to_all(
    send: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None = None
) -> tuple[torch.Tensor, dist.Work | None]:
    """Launch the all-to-all of ``send [P, ...]`` without waiting: ``(recv, work)``; ``recv`` is valid after
    ``work.wait()``. Not differentiable (the head-chunked attention writes its backward by hand)."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    if stats is not None:
        stats.record("all_to_all", send)
    return recv, work


def _kv_send(x: torch.Tensor, sp: int) -> torch.Tensor:
    # x: [b, Hkv, n, d] -> [P, b, hkv, n, d]: the kv heads that rank j's query heads read.
    b, hkv_total, n, d = x.shape
    if hkv_total >= sp:
        return x.reshape(b, sp, hkv_total // sp, n, d).transpose(0, 1)
    # Fewer kv heads than ranks: ranks j*Hkv/P .. share kv head j // (P / Hkv); it is sent to each of them
    # (index_select's backward sums the gradients that come back).
    index = torch.arange(sp, device=x.device) // (sp // hkv_total)
    return x.index_select(1, index).unsqueeze(2).transpose(0, 1)


def _kv_send_grad(grad: torch.Tensor, num_kv_heads: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    # The adjoint of _kv_send: [P, b, hkv, n, d] -> [b, Hkv, n, d], summing the copies sent to several ranks (in
    # ``dtype``: each copy cast before the sum). dtype: cast to it in the copy the layout makes anyway.
    sp, b, hkv, n, d = grad.shape
    if num_kv_heads >= sp:
        grad = grad.transpose(0, 1)  # [b, P, hkv, n, d]
        if dtype is not None:  # (as in _merge_ranks)
            grad = grad.to(dtype, memory_format=torch.contiguous_format)
        return grad.reshape(b, num_kv_heads, n, d)
    copies = sp // num_kv_heads  # ranks that read one kv head
    return grad.reshape(num_kv_heads, copies, b, n, d).sum(1, dtype=dtype).transpose(0, 1)


def qkv_send_parts(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, sp: int) -> Joined:
    """q ``[b, H, n, d]``, k/v ``[b, Hkv, n, d]`` -> the send buffer ``[P, b, H/P + 2 hkv, n, d]`` (row j to rank j)
    as views side by side (:class:`Joined`); q alone (k, v None) or k/v alone (q None): ``[P, b, H/P, n, d]`` or
    ``[P, b, 2 hkv, n, d]``."""
    parts = []
    if q is not None:
        b, num_heads, n, d = q.shape
        parts.append(q.reshape(b, sp, num_heads // sp, n, d).transpose(0, 1))  # [P, b, H/P, n, d]
    if k is not None and v is not None:
        parts += [_kv_send(k, sp), _kv_send(v, sp)]
    return Joined(tuple(parts), 2)


def qkv_send_buffer(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, sp: int) -> torch.Tensor:
    """:func:`qkv_send_parts` as one tensor."""
    return qkv_send_parts(q, k, v, sp).tensor()


def qkv_send_grad(
    grad: torch.Tensor, num_heads: int, num_kv_heads: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor | None, ...]:
    """The adjoint of :func:`qkv_send_buffer`: the send buffer's gradient -> the gradients of q, k, v (None for
    what it did not send: ``num_heads`` or ``num_kv_heads`` 0); ``dtype``: cast to it (as :func:`qkv_full`)."""
    sp, b, rows, n, d = grad.shape
    heads_q = num_heads // sp
    hkv = (rows - heads_q) // 2
    dq, dk, dv = grad.split([heads_q, hkv, hkv], dim=2)
    if num_heads:
        dq = dq.transpose(0, 1)  # [b, P, H/P, n, d]
        if dtype is not None:  # (as in _merge_ranks)
            dq = dq.to(dtype, memory_format=torch.contiguous_format)
        dq = dq.reshape(b, num_heads, n, d)
    else:
        dq = None
    if not num_kv_heads:
        return dq, None, None
    return dq, _kv_send_grad(dk, num_kv_heads, dtype), _kv_send_grad(dv, num_kv_heads, dtype)


def _merge_ranks(recv: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # [P, b, x, y, d] -> [b, x, P y, d]: the source ranks' pieces side by side in dim 2 (a copy). dtype: cast to it in
    # the same copy, laid out contiguously (the flatten is then a view), not a cast and then the flatten's copy.
    merged = recv.permute(1, 2, 0, 3, 4)  # [b, x, P, y, d]
    if dtype is not None:
        merged = merged.to(dtype, memory_format=torch.contiguous_format)
    return merged.flatten(2, 3)


def _split_ranks(t: torch.Tensor, sp: int) -> torch.Tensor:
    # The adjoint of _merge_ranks: [b, x, P y, d] -> [P, b, x, y, d] (a view)
    return t.unflatten(2, (sp, -1)).permute(2, 0, 1, 3, 4)


def qkv_full(recv: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The received buffer ``[P (src shard), b, h, n, d]`` -> ``[b, h, N, d]`` (a copy, in sequence order);
    ``dtype``: cast to it in that same copy (a buffer received in a wire dtype; None: as it is)."""
    return _merge_ranks(recv, dtype)


def qkv_full_grad(grad: torch.Tensor, sp: int) -> torch.Tensor:
    """The adjoint of :func:`qkv_full`: ``[b, h, N, d]`` -> ``[P, b, h, n, d]`` (a view: the exchange copies it)."""
    return _split_ranks(grad, sp)


def out_send_buffer(out: torch.Tensor, sp: int) -> torch.Tensor:
    """The core's output ``[b, N, h, d]`` -> the send buffer ``[P (dst shard), b, n, h, d]`` (a view)."""
    b, seq_len, heads, d = out.shape
    return out.reshape(b, sp, seq_len // sp, heads, d).transpose(0, 1)


def out_send_grad(grad: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The adjoint of :func:`out_send_buffer`: ``[P, b, n, h, d]`` -> ``[b, N, h, d]`` (``dtype``: as
    :func:`qkv_full`)."""
    sp, b, n, heads, d = grad.shape
    grad = grad.transpose(0, 1)  # [b, P, n, h, d]
    if dtype is not None:  # (as in _merge_ranks)
        grad = grad.to(dtype, memory_format=torch.contiguous_format)
    return grad.reshape(b, sp * n, heads, d)


def out_local(recv: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The received output ``[P (src heads), b, n, h, d]`` -> ``[b, n, P h, d]`` (this rank's tokens, all heads;
    ``dtype``: as :func:`qkv_full`)."""
    return _merge_ranks(recv, dtype)


def out_local_grad(grad: torch.Tensor, sp: int) -> torch.Tensor:
    """The adjoint of :func:`out_local`: ``[b, n, P h, d]`` -> ``[P, b, n, h, d]`` (a view: the exchange copies it)."""
    return _split_ranks(grad, sp)


def out_pack_send(sp: int, *parts: torch.Tensor) -> Joined:
    """``[b, n, P h, d_i]`` tensors (any strides) -> one send buffer ``[P, b, n, h, sum d_i]``: :func:`out_local_grad`
    of each, side by side in the last dim (:class:`Joined`; they travel in one all-to-all, :func:`out_send_grad`
    then splits)."""
    return Joined(tuple(_split_ranks(t, sp) for t in parts), -1)


@dataclass(frozen=True)
class Joined:
    """Send-buffer pieces ``[P, ...]`` of one dtype (any strides) side by side along ``dim``: the buffer
    ``torch.cat(pieces, dim)`` makes, which :func:`pack_rows` writes straight into its place instead (one copy, not
    two)."""

    pieces: tuple[torch.Tensor, ...]
    dim: int

    @property
    def shape(self) -> torch.Size:
        shape = list(self.pieces[0].shape)
        shape[self.dim] = sum([t.shape[self.dim] for t in self.pieces])
        return torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype

    def tensor(self) -> torch.Tensor:
        """The buffer (the piece itself where there is one)."""
        return self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces, self.dim)

    def write(self, place: torch.Tensor) -> None:
        """Copy the pieces into ``place`` (of the buffer's shape; any dtype: the copy casts)."""
        if len(self.pieces) == 1:
            place.copy_(self.pieces[0])
            return
        # the places side by side: one op for all of them
        places = place.split_with_sizes([t.shape[self.dim] for t in self.pieces], self.dim)
        for t, into in zip(self.pieces, places, strict=True):
            into.copy_(t)


def pack_rows(
    parts: list[torch.Tensor | Joined], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[tuple[torch.Size, torch.dtype, int]]]:
    """Send buffers ``[P, ...]`` (tensors of any dtypes and strides, or :class:`Joined` pieces) -> one ``[P, row]``
    buffer with each rank's rows side by side and the layout; each part copied once, straight into its place (cast
    to ``dtype`` where given). The buffer has the parts' dtype where they share one, else it is bytes (uint8), each
    part's row padded to the widest element size, so that :func:`unpack_rows` reads views."""
    dtypes = [part.dtype for part in parts] if dtype is None else [dtype] * len(parts)
    align = max([t.itemsize for t in dtypes])
    layout, total = [], 0
    for part, part_dtype in zip(parts, dtypes, strict=True):
        shape = part.shape
        size = shape[1:].numel() * part_dtype.itemsize
        layout.append((shape, part_dtype, size + -size % align))
        total += layout[-1][2]
    kind = dtypes[0] if dtypes.count(dtypes[0]) == len(dtypes) else torch.uint8
    first = parts[0].pieces[0] if isinstance(parts[0], Joined) else parts[0]  # [P, ...]: every part's P, device
    send = torch.empty(first.shape[0], total // kind.itemsize, dtype=kind, device=first.device)
    for part, place in zip(parts, unpack_rows(send, layout), strict=True):
        if isinstance(part, Joined):
            part.write(place)
        else:
            place.copy_(part)
    return send, layout


def unpack_rows(recv: torch.Tensor, layout: list[tuple[torch.Size, torch.dtype, int]]) -> list[torch.Tensor]:
    """The parts of a :func:`pack_rows` buffer as received ``[P, row]``: views, in their shapes and dtypes."""
    unit = recv.element_size()
    rows = recv.split_with_sizes([width // unit for *_, width in layout], 1)  # [P, width_i] each, in one op
    found = []
    for row, (shape, dtype, _) in zip(rows, layout, strict=True):
        if dtype != recv.dtype:  # bytes: the part's row without its padding, in its dtype
            row = row.narrow(1, 0, shape.numel() // shape[0] * dtype.itemsize // unit).view(dtype)
        found.append(row.view(shape))
    return found


def qkv_seq_to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    comm_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded q/k/v -> head-sharded q/k/v over the full sequence, in one all-to-all.

    q ``[b, H, n, d]``, k/v ``[b, Hkv, n, d]`` -> q ``[b, H/P, N, d]``, k/v ``[b, hkv, N, d]``.
    ``comm_dtype`` (e.g. ``torch.float32``) casts the payload for the wire and back; default: as is.
    """
    sp = _group_size(group)
    if sp == 1:
        return q, k, v
    send = qkv_send_buffer(q, k, v, sp)  # [P, b, H/P + 2 hkv, n, d]
    heads_q, hkv = q.shape[1] // sp, (send.shape[2] - q.shape[1] // sp) // 2
    dtype = send.dtype
    if comm_dtype is not None:
        send = send.to(comm_dtype, memory_format=torch.contiguous_format)
    recv = all_to_all(send, group, stats)  # [P(src shard), b, H/P + 2 hkv, n, d], in the wire's dtype
    del send  # freed before the reshape's copy: at most two payload-sized buffers at once
    full = qkv_full(recv, None if recv.dtype == dtype else dtype)  # [b, h, N, d] (cast back from the wire: one copy)
    # split (not slicing): its backward concatenates the three gradients instead of zero-filling three
    # buffers of the full size and adding them.
    q_full, k_full, v_full = full.split([heads_q, hkv, hkv], dim=1)
    return q_full, k_full, v_full


def heads_to_seq(
    out: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    comm_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Head-sharded attention output -> sequence-sharded: ``[b, N, H/P, d]`` -> ``[b, n, H, d]``."""
    sp = _group_size(group)
    if sp == 1:
        return out
    send = out_send_buffer(out, sp)  # [P(dst shard), b, n, H/P, d]
    dtype = send.dtype
    if comm_dtype is not None:  # (one copy: a cast keeping the view's strides would be copied again to send)
        send = send.to(comm_dtype, memory_format=torch.contiguous_format)
    recv = all_to_all(send, group, stats)  # [P(src heads), b, n, H/P, d], in the wire's dtype
    del send
    return out_local(recv, None if recv.dtype == dtype else dtype)


# ---------------------------------------------------------------------------------------------- reductions
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):  # type: ignore[override]
        ctx.group, ctx.stats = group, stats
        x = x.clone()
        dist.all_reduce(x, group=group)
        if stats is not None:
            stats.record("all_reduce", x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.stats is not None:
            ctx.stats.record("all_reduce", grad)
        return grad, None, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable sum over the group; its backward sums the incoming gradients over the group too."""
    if _group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group, stats)


def all_gather_tensor(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None) -> torch.Tensor:
    """Non-differentiable all-gather along a new dim 0: ``[...]`` -> ``[P, ...]`` (for metadata). The parts it
    gathers into start zeroed: where a peer sent less (it was in another collective) zeros stay, never stale memory
    (:func:`ulysses_sp.validation.gather_reports` reads that)."""
    size = _group_size(group)
    if size == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    parts = [torch.zeros_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    if stats is not None:
        stats.record("all_gather", x)
    return torch.stack(parts)
