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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "all_gather_tensor",
    "all_reduce_sum",
    "all_to_all",
    "heads_to_seq",
    "qkv_seq_to_heads",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class CommStats:
    """Counts of collectives and bytes sent by this rank, keyed by operation name.

    ``calls["all_to_all"]`` counts forward and backward exchanges alike; ``bytes`` is the payload this
    rank hands to the collective (for an all-to-all: the whole send buffer, of which ``1/P`` stays local).
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


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


def _kv_send(x: torch.Tensor, sp: int) -> torch.Tensor:
    # x: [b, Hkv, n, d] -> [P, b, hkv, n, d]: the kv heads that rank j's query heads read.
    b, hkv_total, n, d = x.shape
    if hkv_total >= sp:
        return x.reshape(b, sp, hkv_total // sp, n, d).transpose(0, 1)
    # Fewer kv heads than ranks: ranks j*Hkv/P .. share kv head j // (P / Hkv); it is sent to each of them
    # (index_select's backward sums the gradients that come back).
    index = torch.arange(sp, device=x.device) // (sp // hkv_total)
    return x.index_select(1, index).unsqueeze(2).transpose(0, 1)


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
    b, num_heads, n, d = q.shape
    heads_q = num_heads // sp
    q_send = q.reshape(b, sp, heads_q, n, d).transpose(0, 1)  # [P, b, H/P, n, d]
    k_send, v_send = _kv_send(k, sp), _kv_send(v, sp)  # [P, b, hkv, n, d]
    hkv = k_send.shape[2]
    send = torch.cat([q_send, k_send, v_send], dim=2)  # [P, b, H/P + 2 hkv, n, d]
    dtype = send.dtype
    if comm_dtype is not None:
        send = send.to(comm_dtype)
    recv = all_to_all(send, group, stats).to(dtype)  # [P(src shard), b, H/P + 2 hkv, n, d]
    del send  # freed before the reshape's copy: at most two payload-sized buffers at once
    full = recv.permute(1, 2, 0, 3, 4).reshape(b, heads_q + 2 * hkv, sp * n, d)  # [b, h, N, d]
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
    b, seq_len, heads_local, d = out.shape
    n = seq_len // sp
    send = out.reshape(b, sp, n, heads_local, d).transpose(0, 1)  # [P(dst shard), b, n, H/P, d]
    dtype = send.dtype
    if comm_dtype is not None:
        send = send.to(comm_dtype)
    recv = all_to_all(send, group, stats).to(dtype)  # [P(src heads), b, n, H/P, d]
    del send
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, sp * heads_local, d)


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
    """Non-differentiable all-gather along a new dim 0: ``[...]`` -> ``[P, ...]`` (for metadata)."""
    size = _group_size(group)
    if size == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    if stats is not None:
        stats.record("all_gather", x)
    return torch.stack(parts)
