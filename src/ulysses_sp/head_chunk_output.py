"""The head-chunked block's output projection in backward: its weight gradient and its input's gradient per chunk,
and the first step of the fused backward (:func:`output_grads`), which reads the cores' saved outputs once.

Used by :mod:`ulysses_sp.head_chunk_pipeline` (:class:`~ulysses_sp.head_chunk_pipeline.ChunkRun`'s backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .chunk_core import output_row_sums
from .head_split import DEPTH

if TYPE_CHECKING:
    from .head_chunk_grads import Accumulators
    from .head_chunk_pipeline import ChunkRun

__all__ = ["out_input_grad", "out_proj_backward", "output_grads"]


def out_proj_backward(
    run: ChunkRun, chunk: int, grad_out: torch.Tensor, local: torch.Tensor, acc: Accumulators
) -> torch.Tensor:
    """The output projection's backward for chunk ``chunk``: its weight columns' gradient into ``acc`` and the
    gradient of its input ``local [b, n, Hc, d_v]`` (returned)."""
    if acc.out_weight is not None:
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b n, h]
        cols = local.shape[-2] * local.shape[-1]
        run.parts.add_mm(run.owner.names.out, chunk, acc.out_weight, grad_2d.t(), local.reshape(-1, cols))
    return out_input_grad(run, chunk, grad_out, local.shape)


def out_input_grad(run: ChunkRun, chunk: int, grad_out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The gradient of chunk ``chunk``'s share of the output projection's input, ``shape [b, n, Hc, d_v]``."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b n, h]
    weight = run.parts.part(run.owner.names.out, chunk, run.owner.out_proj().weight)  # [h, Hc d_v]
    return grad_2d.mm(weight.to(grad_2d.dtype)).view(shape)


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
