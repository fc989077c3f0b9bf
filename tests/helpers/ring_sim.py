"""Ring ranks without processes: a ring of threads in one process, and one rank whose peers echo its blocks.

``run_threads(size, fn)`` runs ``fn(transport)`` on ``size`` threads, each one rank of a ring whose
:class:`ThreadTransport` hands tensors to the next thread: the real ring code (forward and backward) at
ring sizes that spawned gloo worlds cannot afford on two cores. :class:`EchoTransport` is one rank alone:
every exchange returns a copy of what it sent, so the rank computes and allocates exactly what it would
in a ring of ``size`` (the data differs), which is what memory and time measurements need.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.cores import Segments
from ulysses_sp.ring import ring_attention, zigzag_order

__all__ = ["EchoTransport", "ThreadTransport", "one_process_error_sums", "ring_error_sums", "run_threads"]


class ThreadTransport:
    """Rank ``rank`` of a ring of threads sharing ``boxes``: (receiving rank, tag) -> FIFO queue."""

    def __init__(self, rank: int, size: int, boxes: dict, lock: threading.Lock, timeout_s: float = 60.0) -> None:
        self.rank, self.size, self.boxes, self.lock, self.timeout_s = rank, size, boxes, lock, timeout_s

    def _box(self, rank: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((rank, tag), queue.Queue())

    def exchange(self, send: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        self._box((self.rank + 1) % self.size, tag).put(send.clone())
        inbox = self._box(self.rank, tag)
        return lambda: inbox.get(timeout=self.timeout_s)


class EchoTransport:
    """Rank ``rank`` of a ring of ``size`` whose peers send back what it sends (a copy, as a receive would)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def exchange(self, send: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        recv = send.clone()
        return lambda: recv


def run_threads(size: int, fn: Callable[[ThreadTransport], Any], timeout_s: float = 120.0) -> list[Any]:
    """``[fn(transport of rank r) for r]``, the ranks running concurrently; the first error is raised."""
    lock = threading.Lock()
    boxes: dict = {}
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTransport(rank, size, boxes, lock))
        except BaseException as err:  # reported to the caller below
            with lock:
                errors.append(err)

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"a ring of {size} threads did not finish in {timeout_s} s")
    return results


def _problem(dtype, seq_len, batch, heads, kv_heads, head_dim):
    # q, k, v, grad in `dtype`, and float64 attention (output, dq, dk, dv) on the same rounded inputs
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(batch, h, seq_len, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    out.backward(grad.double())
    return (q, k, v, grad), [out.detach()] + [x.grad for x in ref]


def _sums(got: list[torch.Tensor], want: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(
            [torch.stack([(a.double() - b).pow(2).sum(), b.pow(2).sum()]) for a, b in zip(got, want, strict=True)]
        )


def ring_error_sums(
    group: Any, rank: int, size: int, *, dtype: torch.dtype = torch.bfloat16, seq_len: int = 64, batch: int = 2,
    heads: int = 4, kv_heads: int = 2, head_dim: int = 16, kernel: str | None = None, query_chunk: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[4, 2]`` float64: (squared error, squared reference) of this rank's out, dq, dk, dv from ring attention in
    ``dtype`` against float64 attention on the same (rounded) inputs; sum them over the ring and take
    ``sqrt(error / reference)`` for the relative RMS error of the whole sequence."""
    (q, k, v, grad), want = _problem(dtype, seq_len, batch, heads, kv_heads, head_dim)
    n = seq_len // size
    mine = zigzag_order(seq_len, size)[rank * n : (rank + 1) * n]
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    segments = Segments.from_positions(torch.arange(seq_len).expand(batch, seq_len))
    out = ring_attention(*local, segments, group, kernel=kernel, query_chunk=query_chunk).transpose(1, 2)
    assert out.dtype == dtype
    out.backward(grad[:, :, mine])
    return _sums([out] + [x.grad for x in local], [x[:, :, mine] for x in want])


def one_process_error_sums(*, dtype: torch.dtype = torch.bfloat16, **shape: int) -> torch.Tensor:
    """The same sums for one process running sdpa in ``dtype`` on the whole sequence (the bf16 baseline)."""
    (q, k, v, grad), want = _problem(dtype, *(shape.get(n, d) for n, d in _SHAPE))
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
    out.backward(grad)
    return _sums([out] + [x.grad for x in inputs], want)


_SHAPE = (("seq_len", 64), ("batch", 2), ("heads", 4), ("kv_heads", 2), ("head_dim", 16))
