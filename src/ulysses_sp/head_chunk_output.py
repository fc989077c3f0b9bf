"""The head-chunked block's output projection: each chunk's share in forward (and its LoRA adapters'); in backward
its weight gradient and its input's gradient per chunk, and the first step of the fused backward
(:func:`output_grads`), which reads the cores' saved outputs once.

Used by :mod:`ulysses_sp.head_chunk_pipeline` (:class:`~ulysses_sp.head_chunk_pipeline.ChunkRun`'s backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .chunk_core import output_row_sums
from .grad_sums import cast, sum_dtype
from .head_chunk_lora import adapter_grads, adapter_low
from .head_split import DEPTH
from .tiling import compute_dtype

if TYPE_CHECKING:
    from .head_chunk_grads import Accumulators
    from .head_chunk_pipeline import ChunkRun

__all__ = ["out_finish", "out_input_grad", "out_proj_backward", "out_share", "out_start", "output_grads"]


def out_start(run: ChunkRun, x: torch.Tensor) -> torch.Tensor:
    """The block's output sum ``[b, n, h]`` (zeros, in the dtype the projections compute in, for input ``x``); and
    ``run.out_low``, zeroed sums of ``dropout(y) A^T [b, n, r]`` over the chunks, one per LoRA adapter of the output
    projection (fp32 under a 16-bit dtype)."""
    out = x.new_zeros(*x.shape[:-1], run.parts.out_proj.out_features, dtype=compute_dtype(x))
    adapters = run.parts.adapters(run.owner.names.out)
    run.out_low = [out.new_zeros(*out.shape[:-1], a.a.shape[0], dtype=sum_dtype(out.dtype, True)) for a in adapters]
    return out


def out_share(run: ChunkRun, chunk: int, local: torch.Tensor, out: torch.Tensor) -> None:
    """Chunk ``chunk``'s share of the output projection: its columns of the weight times ``local [b, n, Hc, d_v]``
    added into ``out [b, n, h]``; LoRA: ``dropout(y_c) A_c^T`` into ``run.out_low``."""
    name = run.owner.names.out
    weight = run.parts.part(name, chunk, run.parts.out_proj.weight)  # [h, Hc d_v]
    local_2d = local.reshape(-1, weight.shape[1])  # [b n, Hc d_v]
    out.view(-1, out.shape[-1]).addmm_(local_2d, cast(weight.t(), out.dtype))
    adapters = run.parts.adapters(name)
    if adapters:
        local_3d, columns = local.flatten(-2), run.parts.columns(chunk, local.device)  # [b, n, Hc d_v]
        for low, adapter in zip(run.out_low, adapters, strict=True):
            low.add_(adapter_low(adapter, local_3d, columns=columns))  # its dropout keys: the call's (cached)


def out_finish(run: ChunkRun, out: torch.Tensor) -> torch.Tensor:
    """``out [b, n, h]`` (every chunk's share) plus the output projection's bias and its LoRA adapters'
    ``s (dropout(y) A^T) B^T``."""
    out_proj = run.parts.out_proj
    if out_proj.bias is not None:
        out += out_proj.bias
    for low, adapter in zip(run.out_low, run.parts.adapters(run.owner.names.out), strict=True):
        dtype = adapter.dtype(out.dtype)
        out.add_(cast(low, dtype) @ cast(adapter.b.t(), dtype) * adapter.scaling)
    return out


def out_proj_backward(
    run: ChunkRun, chunk: int, grad_out: torch.Tensor, local: torch.Tensor, acc: Accumulators
) -> torch.Tensor:
    """The output projection's backward for chunk ``chunk``: its weight columns' gradient into ``acc`` and the
    gradient of its input ``local [b, n, Hc, d_v]`` (returned)."""
    name, local_2d = run.owner.names.out, local.reshape(-1, local.shape[-2] * local.shape[-1])  # [b n, Hc d_v]
    if acc.out_weight is not None:
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b n, h]
        run.parts.add_mm(name, chunk, acc.out_weight, grad_2d.t(), local_2d)
    return out_input_grad(run, chunk, grad_out, local.shape, local, acc)


def out_input_grad(
    run: ChunkRun,
    chunk: int,
    grad_out: torch.Tensor,
    shape: torch.Size,
    local: torch.Tensor | None = None,
    acc: Accumulators | None = None,
) -> torch.Tensor:
    """The gradient of chunk ``chunk``'s share of the output projection's input, ``shape [b, n, Hc, d_v]``; with
    that input ``local`` and ``acc``, its LoRA adapters' gradients of A's columns too (into ``acc``), in the same
    pass over the dropout's masks."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b n, h]
    name = run.owner.names.out
    weight = run.parts.part(name, chunk, run.parts.out_proj.weight)  # [h, Hc d_v]
    grad = grad_2d.mm(cast(weight, grad_2d.dtype)).view(*shape[:-2], -1)  # [b, n, Hc d_v]
    columns = run.parts.columns(chunk, grad.device) if run.out_low_grads else None
    for adapter, low_grad in run.out_low_grads:  # LoRA: dropout'((s g B) A_c), A_c += (s g B)^T dropout(y_c)
        part = total = None
        if local is not None and acc is not None and acc.need.get(id(adapter.a)):
            total = acc.sum(adapter.a)  # [r, h_in]
            part = total.new_zeros(total.shape[0], len(columns))
        y = None if part is None else local.flatten(-2)  # [b, n, Hc d_v]
        adapter_grads(adapter, low_grad, y, columns=columns, a_target=part, x_target=grad)
        if part is not None:
            run.parts.add(name, chunk, total, part)
    return grad.view(shape)


def output_grads(
    run: ChunkRun, grad_out: torch.Tensor, saved: list[torch.Tensor | None], lse: tuple, acc: Accumulators
) -> list[list | None]:
    """Before the chunks run: for every chunk whose core ran through a kernel, the output projection's weight
    gradient (into ``acc``) and the row sums ``D [b, n, Hc, 1]`` of its output with the output's gradient, all that
    the rest of its backward reads of its saved output ``saved[c] [b, n, Hc, d_v]`` (set to None here: under this
    library's checkpointing or offloading, which hand the saved tensors over, the outputs are freed before the
    chunks' backward; without either autograd holds them until this backward returns). Returns per chunk ``[grad,
    D, shape]`` (None: not through a kernel): the output's gradient kept for the first DEPTH chunks (the next ones'
    is made again from ``grad_out`` when they run, one matmul each, instead of being held all along)."""
    found: list[list | None] = [None] * run.split.chunks
    for order, chunk in enumerate(c for c in range(run.split.chunks) if lse[c] is not None):
        local, saved[chunk] = saved[chunk], None  # [b, n, Hc, d_v]
        grad_local = out_proj_backward(run, chunk, grad_out, local, acc)
        found[chunk] = [grad_local if order < DEPTH else None, output_row_sums(grad_local, local), local.shape]
        del grad_local
    return found
