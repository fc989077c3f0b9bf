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

from typing import Any

import torch
import torch.nn.functional as F

from .cores import AttentionCall
from .ring_kernels import default_ring_kernel, get_ring_kernel

__all__ = ["KERNEL_CORES", "chunk_kernel", "kernel_backward", "kernel_forward", "output_row_sums", "stand_in_output"]

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
    q_k, k_k, v_k = (t.to(dtype) for t in (q, k, v))
    if call.segments.is_dense:
        out, lse = kernel.forward(q_k, k_k, v_k, causal=True, scale=scale)
    else:
        out = q_k.new_zeros(q.shape)
        lse = torch.zeros(q.shape[:3], dtype=torch.promote_types(dtype, torch.float32), device=q.device)
        for row, s, e in _documents(call):
            piece = (slice(row, row + 1), slice(None), slice(s, e))
            out[piece], lse[piece] = kernel.forward(q_k[piece], k_k[piece], v_k[piece], causal=True, scale=scale)
    return out[..., : call.d_v].transpose(1, 2).to(q.dtype), lse


def kernel_backward(
    kernel: Any,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    call: AttentionCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q/k/v (their shapes and dtype) for the output's gradient ``grad [b, N, h, d_v]``, from the
    forward's ``out [b, N, h, d_v]`` and ``lse``."""
    dtype, scale = kernel.compute_dtype(q.dtype), _scale(call, q)
    width = q.shape[-1]

    def heads_major(t: torch.Tensor) -> torch.Tensor:  # [b, N, h, d_v] -> [b, h, N, w]
        padded = F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t
        return padded.transpose(1, 2).to(dtype)

    g_k, o_k = heads_major(grad), heads_major(out)
    q_k, k_k, v_k = (t.to(dtype) for t in (q, k, v))
    if call.segments.is_dense:
        grads = kernel.backward(g_k, q_k, k_k, v_k, o_k, lse, causal=True, scale=scale)
    else:
        grads = tuple(torch.zeros_like(t) for t in (q_k, k_k, v_k))
        for row, s, e in _documents(call):
            piece = (slice(row, row + 1), slice(None), slice(s, e))
            found = kernel.backward(
                g_k[piece], q_k[piece], k_k[piece], v_k[piece], o_k[piece], lse[piece], causal=True, scale=scale
            )
            for target, part in zip(grads, found, strict=True):
                target[piece] = part
    return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]


def output_row_sums(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``sum_d grad * out`` per token and head (``[..., d_v]`` each -> ``[..., 1]``): all that the kernels' backward
    reads of the output (flash attention's ``D``, the softmax gradient's row term); in ``grad``'s dtype."""
    return torch.linalg.vecdot(grad, out.to(grad.dtype)).unsqueeze(-1)


def stand_in_output(grad: torch.Tensor, row_sums: torch.Tensor) -> torch.Tensor:
    """An output for :func:`kernel_backward` whose :func:`output_row_sums` with ``grad [..., d_v]`` are ``row_sums
    [..., 1]``: ``grad * D / |grad|^2`` per row (0 where the gradient's row is 0, and then D is 0 too). The kernels
    read the output only through those sums, so their gradients are the true output's; no larger than the true
    output row by row (Cauchy-Schwarz: ``|D| <= |grad| |out|``)."""
    norm2 = torch.linalg.vector_norm(grad, dim=-1, keepdim=True, dtype=torch.float32).square()
    scale = torch.where(norm2 > 0, row_sums.float() / norm2, 0.0)  # [..., 1] fp32
    if grad.dtype == torch.float16:  # the scale may pass fp16's range where the gradient is small
        return (grad.float() * scale).to(grad.dtype)
    return grad * scale.to(grad.dtype)
