"""The unchunked core in slices of its heads, so a fused kernel's backward buffers exist for one slice at a time.

After the exchange a rank attends over the whole sequence for its H/U query heads. A fused kernel's backward
allocates, besides q/k/v's gradients, buffers over all the heads it is given: FlashAttention-2's ``mha_bwd``
(torch's flash sdpa backend) an fp32 dq accumulator ``[b, N, h, d]`` and, under GQA, the k/v gradients per query
head before they are summed per kv head (two more ``[b, N, h, d]``); torch's CUDA aten ops repeat the kv heads
for the query heads. At long sequences these are the largest tensors of a layer's backward (Llama-3.1-8B at sp=8
and 1M tokens per rank: 32 GiB). :class:`SlicedCore` calls the block kernel of :mod:`ulysses_sp.chunk_core` once
per slice of query heads (with the kv heads they read), in forward and in backward: same arithmetic, the saved
tensors are sdpa's own (q, k, v, the output and the fp32 log-sum-exp), and the kernel's buffers are those of
one slice. The k/v gradients of a kv head read by several slices are summed in place.

:func:`sliced_core` says when: the ``sdpa`` core without a ring (what :func:`ulysses_sp.chunk_core.chunk_kernel`
allows: no dropout, window or softcap) and more than one slice by :func:`ulysses_sp.head_split.core_slices`, whose
budget is the attention's (``head_chunk_budget_bytes`` of :func:`ulysses_sp.parallelize`). Otherwise the core
runs as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .chunk_core import chunk_kernel, kernel_backward, kernel_forward
from .cores import AttentionCall
from .head_split import HeadSplit, core_slices
from .tiling import compute_dtype

__all__ = ["SlicedCore", "sliced_core"]


class SlicedCore(torch.autograd.Function):
    """out ``[b, N, h, d_v]`` = causal attention of q ``[b, h, N, w]`` to k/v ``[b, hkv, N, w]``, ``split``'s
    slices of heads one at a time through ``kernel``."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Any, call: AttentionCall, split: HeadSplit
    ) -> torch.Tensor:
        b, h, n, _ = q.shape
        out = q.new_empty(b, h, n, call.d_v)  # heads first, so that a slice's is contiguous for the kernel
        lse = None
        for s in range(split.chunks):
            (q0, qn), (k0, kn) = split.query_heads(s), split.kv_heads(s)
            o, l = kernel_forward(kernel, q[:, q0 : q0 + qn], k[:, k0 : k0 + kn], v[:, k0 : k0 + kn], call)
            if lse is None:
                lse = l.new_empty(b, h, n)
            out[:, q0 : q0 + qn] = o.transpose(1, 2)  # [b, qn, N, d_v]
            lse[:, q0 : q0 + qn] = l  # [b, qn, N]
            del o, l
        ctx.kernel, ctx.call, ctx.split = kernel, call, split
        ctx.save_for_backward(q, k, v, out, lse)
        return out.transpose(1, 2)  # [b, N, h, d_v], a view, as the sdpa core returns it

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        split = ctx.split
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s in range(split.chunks):
            (q0, qn), (k0, kn) = split.query_heads(s), split.kv_heads(s)
            qs, ks = slice(q0, q0 + qn), slice(k0, k0 + kn)
            slice_out = out[:, qs].transpose(1, 2)  # [b, N, qn, d_v]
            # one call a slice (its gradients are copied into the core's whole ones below, as the planner counts)
            gq, gk, gv = kernel_backward(
                ctx.kernel,
                grad[:, :, qs],
                q[:, qs],
                k[:, ks],
                v[:, ks],
                slice_out,
                lse[:, qs],
                ctx.call,
                blocked=False,
            )
            dq[:, qs] = gq
            dk[:, ks] += gk
            dv[:, ks] += gv
            del gq, gk, gv  # the next slice's kernel reuses their memory
        return dq, dk, dv, None, None, None


def sliced_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, *, core_name: str, budget_bytes: int
) -> torch.Tensor | None:
    """The core's output ``[b, N, h, d_v]`` through :class:`SlicedCore` where it applies (module docstring), else
    None. q ``[b, h, N, w]``, k/v ``[b, hkv, N, w]``."""
    if core_name != "sdpa":
        return None
    dtype = compute_dtype(q)  # under autocast its dtype, as autocast's sdpa casts them (RoPE may leave q/k fp32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    b, h, n, _ = q.shape
    slices = core_slices(h, k.shape[1], tokens=b * n, head_dim=q.shape[-1], budget_bytes=budget_bytes)
    if slices == 1:
        return None
    kernel = chunk_kernel(call, q, ring=1, core_name=core_name)
    if kernel is None:
        return None
    return SlicedCore.apply(q, k, v, kernel, call, HeadSplit(h, k.shape[1], slices))
