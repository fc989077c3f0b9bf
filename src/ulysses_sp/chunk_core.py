"""The core of one head chunk through a block kernel that returns the log-sum-exp, so backward needs no recompute.

A head-chunked attention layer (:mod:`ulysses_sp.head_chunk_pipeline`) saves its input only; without this module
its backward runs each chunk's core forward again to get the graph of the core's backward. With a kernel of
:mod:`ulysses_sp.ring_kernels` (``cpu_flash`` on the CPU, the CUDA sdpa ops on a GPU) the forward keeps the core's
output (after the exchange back, as the output projection's input; one ``[tokens, H d_v]`` tensor per layer) and
the fp32 log-sum-exp (``[b, H/U, N]``), and the backward calls the kernel's fused backward with them: the same
arithmetic as the sdpa core's autograd, one core forward less per chunk, and one all-to-all less (the output's
gradient travels to the attending ranks with the output's row sums, all the kernels read of the output:
:func:`stand_in_output` gives them an output with those sums).

:func:`chunk_kernel` says when: no ring (the ring has its own kernels), no dropout (the kernels take no RNG
state), no sliding window and no softcap (the causal kernels apply neither), one of the named fused cores
(:data:`KERNEL_CORES`: not the eager reference, not a core passed as a callable). Rows packed with several
documents, and padding, run one kernel call per document. Every other call keeps the recomputing backward, which
is exact too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .cores import AttentionCall
from .grad_sums import cast, sum_dtype
from .ring_kernels import acc_dtype, default_ring_kernel, get_ring_kernel

__all__ = [
    "KERNEL_CORES",
    "chunk_kernel",
    "kernel_backward",
    "kernel_blocks",
    "kernel_forward",
    "output_row_sums",
    "stand_in_output",
]

# The cores whose arithmetic a block kernel reproduces (exact causal attention through a fused kernel).
KERNEL_CORES = ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def chunk_kernel(call: AttentionCall, q: torch.Tensor, *, ring: int, core_name: str) -> Any | None:
    """A fresh block kernel for a chunk's core with this call on q ``[b, h, N, w]``, or None (recompute)."""
    if ring > 1 or core_name not in KERNEL_CORES or call.dropout or call.window is not None or call.softcap is not None:
        return None
    name = default_ring_kernel(q.device, q.dtype, q.shape[-1], None)
    if name not in ("cpu_flash", "cuda_flash", "cuda_efficient"):
        return None
    return get_ring_kernel(name)


def _scale(call: AttentionCall, q: torch.Tensor) -> float:
    return call.scaling if call.scaling is not None else q.shape[-1] ** -0.5


def _documents(call: AttentionCall) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document; padding gaps are left out."""
    return [(row, s, e) for row, spans in enumerate(call.segments.spans) for s, e in spans]


def kernel_forward(
    kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, h, N, w]``, k/v ``[b, hkv, N, w]`` -> (out ``[b, N, h, d_v]`` in q's dtype, lse ``[b, h, N]``).

    Causal per document; padding rows get a zero output (and a zero lse, never read: their gradient is zero)."""
    dtype, scale = kernel.compute_dtype(q.dtype), _scale(call, q)
    q_k, k_k, v_k = cast(q, dtype), cast(k, dtype), cast(v, dtype)
    if call.segments.is_dense:
        out, lse = kernel.forward(q_k, k_k, v_k, causal=True, scale=scale)
    else:
        out = q_k.new_zeros(q.shape)
        lse = torch.zeros(q.shape[:3], dtype=acc_dtype(dtype), device=q.device)
        for row, s, e in _documents(call):
            piece = (slice(row, row + 1), slice(None), slice(s, e))
            out[piece], lse[piece] = kernel.forward(q_k[piece], k_k[piece], v_k[piece], causal=True, scale=scale)
    return cast(out[..., : call.d_v].transpose(1, 2), q.dtype), lse


# The backward of a long chunk's core runs in blocks of queries and keys: each call's gradients (and the stand-in
# output of its query rows) are a block's, not the whole chunk's; at most KERNEL_BLOCKS blocks a document (calls:
# blocks x (blocks + 1) / 2, the causal triangle), each at least MIN_BLOCK_ROWS long.
KERNEL_BLOCKS = 4
MIN_BLOCK_ROWS = 4096


def kernel_blocks(tokens: int) -> int:
    """How many query (and key) blocks :func:`kernel_backward` splits a document of ``tokens`` into."""
    return max(1, min(KERNEL_BLOCKS, tokens // MIN_BLOCK_ROWS))


def kernel_backward(
    kernel: Any,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor,
    call: AttentionCall,
    *,
    row_sums: torch.Tensor | None = None,
    add_kv: Callable[[tuple, torch.Tensor, torch.Tensor], None] | None = None,
    blocked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of q/k/v (their shapes and dtype) for the output's gradient ``grad [b, N, h, d_v]``, from the
    forward's ``out [b, N, h, d_v]`` (or, ``out`` None, the output's ``row_sums`` with ``grad``, ``[b, N, h, 1]``: a
    :func:`stand_in_output` is made block by block) and ``lse``.

    ``blocked``: a document of at least 2 :data:`MIN_BLOCK_ROWS` tokens runs in blocks (:func:`kernel_blocks`): a
    diagonal block causal, the blocks below it in full, each with its query rows' lse and output, their partial
    gradients summed (fp32 for a 16-bit kernel). ``add_kv(piece, dk, dv)``: take the k/v gradients of the rows ``piece``
    (indices into ``[b, hkv, N]``) instead of summing them here (they are then returned as None)."""
    dtype, scale = kernel.compute_dtype(q.dtype), _scale(call, q)
    width = q.shape[-1]

    def heads_major(t: torch.Tensor) -> torch.Tensor:  # [b, n, h, d_v] -> [b, h, n, w]
        padded = F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t
        return cast(padded.transpose(1, 2), dtype)

    def output(rows: tuple[slice, slice] | None = None) -> torch.Tensor:  # [b, n, h, d_v] of the query rows (all)
        if rows is None:
            return out if out is not None else stand_in_output(grad, row_sums)
        if out is not None:
            return out[rows]
        return stand_in_output(grad[rows], row_sums[rows])

    docs = (
        [(slice(None), 0, q.shape[2])]
        if call.segments.is_dense
        else [(slice(row, row + 1), s, e) for row, s, e in _documents(call)]
    )
    blocks = [(row, _spans(s, e, blocked)) for row, s, e in docs]
    if call.segments.is_dense and len(blocks[0][1]) == 1:  # one call: its gradients as they are
        found = kernel.backward(
            heads_major(grad),
            cast(q, dtype),
            cast(k, dtype),
            cast(v, dtype),
            heads_major(output()),
            lse,
            causal=True,
            scale=scale,
        )
        dq, dk, dv = cast(found[0], q.dtype), cast(found[1], k.dtype), cast(found[2], v.dtype)
        if add_kv is None:
            return dq, dk, dv
        add_kv((slice(None), slice(None), slice(None)), dk, dv)
        return dq, None, None
    wide = sum_dtype(dtype, True)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv_sums = None
    if add_kv is None:
        kv_sums = tuple(torch.zeros(t.shape, dtype=wide, device=t.device) for t in (k, v))

        def add_kv(piece: tuple, dk: torch.Tensor, dv: torch.Tensor) -> None:
            kv_sums[0][piece].add_(dk)
            kv_sums[1][piece].add_(dv)

    for row, spans in blocks:
        for i, (q0, q1) in enumerate(spans):
            rows = (row, slice(q0, q1))
            g_k, o_k = heads_major(grad[rows]), heads_major(output(rows))
            q_k, lse_k = cast(q[row, :, q0:q1], dtype), lse[row, :, q0:q1]
            for k0, k1 in spans[: i + 1]:
                keys = (row, slice(None), slice(k0, k1))
                part_q, part_k, part_v = kernel.backward(
                    g_k, q_k, cast(k[keys], dtype), cast(v[keys], dtype), o_k, lse_k, causal=k0 == q0, scale=scale
                )
                dq[row, :, q0:q1] += part_q
                add_kv(keys, part_k, part_v)
                del part_q, part_k, part_v
            del g_k, o_k, q_k
    if kv_sums is None:
        return cast(dq, q.dtype), None, None
    return cast(dq, q.dtype), cast(kv_sums[0], k.dtype), cast(kv_sums[1], v.dtype)


def _spans(start: int, end: int, blocked: bool) -> list[tuple[int, int]]:
    """``(start, end)`` of each block of the tokens ``start..end``."""
    count = kernel_blocks(end - start) if blocked else 1
    size = -(-(end - start) // count)
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def output_row_sums(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``sum_d grad * out`` per token and head (``[..., d_v]`` each -> ``[..., 1]``): all that the kernels' backward
    reads of the output (flash attention's ``D``, the softmax gradient's row term); in ``grad``'s dtype."""
    return torch.linalg.vecdot(grad, cast(out, grad.dtype)).unsqueeze(-1)


def stand_in_output(grad: torch.Tensor, row_sums: torch.Tensor) -> torch.Tensor:
    """An output for :func:`kernel_backward` whose :func:`output_row_sums` with ``grad [..., d_v]`` are ``row_sums
    [..., 1]``: ``grad * D / |grad|^2`` per row (0 where the gradient's row is 0, and then D is 0 too). The kernels
    read the output only through those sums, so their gradients are the true output's; no larger than the true
    output row by row (Cauchy-Schwarz: ``|D| <= |grad| |out|``)."""
    wide = acc_dtype(grad.dtype)
    norm2 = torch.linalg.vector_norm(grad, dim=-1, keepdim=True, dtype=wide).square()
    scale = (cast(row_sums, wide) / norm2).masked_fill_(norm2 <= 0, 0.0)  # [..., 1] fp32 (fp64 for fp64)
    if grad.dtype == torch.float16:  # the scale may pass fp16's range where the gradient is small
        return (grad.float() * scale).to(grad.dtype)
    return grad * cast(scale, grad.dtype)
