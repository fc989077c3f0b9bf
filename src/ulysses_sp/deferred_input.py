"""The head-chunked block's input, when a tiled norm made it: kept as the norm's input and remade tile by tile.

Why: in backward the head-chunked block (:mod:`ulysses_sp.head_chunk_pipeline`) projects its input ``x`` (the
input norm's output, ``[b, n, h]``) once per chunk, so it saved ``x`` from the layer's recompute to the end of its
attention's backward: one ``[tokens, hidden]`` tensor held through the MLP's backward, where the tiled layer peaks.
When a tiled norm of the layer made ``x`` (:mod:`ulysses_sp.tiled_norms`), the block saves the norm's input instead
(the residual stream, which the layer holds anyway), and its backward never makes ``x`` whole: each projection of
``x``, and each projection's weight gradient, remakes it one tile of tokens at a time (:class:`NormRemake`).

How: backward runs the module's own forward (for a chunk's q/k/v) on an :class:`Absent` tensor, which has ``x``'s
shape, dtype and device but no data; the sliced projections recognise it and project the remade tiles. Any other use
of its data raises :class:`InputTouched`. Whether a module uses its input only through those projections is found on
its first chunked call (:meth:`ulysses_sp.head_chunks.HeadChunkedAttention.verify`, on the probe); a module that
does not (MLA projects its input through ``q_a_proj`` / ``kv_a_proj_with_mqa``, which are not sliced) keeps saving
``x``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .tiling import _spans

__all__ = ["Absent", "InputTouched", "NormRemake"]

# What an Absent tensor answers: its metadata (properties, and the methods that read them).
_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_cpu", "size", "dim", "ndimension"}
)


class InputTouched(RuntimeError):
    """An operation read the data of an :class:`Absent` tensor."""


class Absent(torch.Tensor):
    """A tensor of a given shape, dtype and device with no data: its metadata can be read, any operation on it
    raises :class:`InputTouched`."""

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Absent:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"Absent(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: the descriptor's name
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise InputTouched(f"{name or func} used the data of the block's input, which backward does not keep")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise InputTouched(f"{func} used the data of the block's input, which backward does not keep")


class NormRemake:
    """How to remake a tiled norm's output from its input ``source [b, n, h]``, ``tile`` tokens at a time:
    ``remake`` (the norm's forward on one tile) under ``replay`` (the autocast and RNG state it ran under)."""

    def __init__(
        self,
        remake: Callable[[torch.Tensor], torch.Tensor],
        tile: int,
        replay: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.remake, self.tile, self.replay = remake, tile, replay

    def tiles(self, source: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, length, x[..., start : start + length, :])`` over the tokens, each tile made when asked for."""
        for start, length in _spans(source.shape[-2], self.tile):
            with torch.no_grad(), self.replay():
                x = self.remake(source.narrow(-2, start, length).contiguous())  # [b, tile, h]
            yield start, length, x

    def project(self, source: torch.Tensor, linear: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """``linear(x)`` (a projection) for the norm's output ``x`` (no graph; under the caller's autocast state),
        tile by tile into one ``[b, n, out]`` tensor: ``linear(tile, start)``, ``start`` its first token."""
        out: torch.Tensor | None = None
        for start, length, x in self.tiles(source):
            with torch.no_grad():
                y = linear(x, start)  # [b, tile, out]
            if length == source.shape[-2]:
                return y
            if out is None:
                out = y.new_empty(*source.shape[:-1], y.shape[-1])
            out.narrow(-2, start, length).copy_(y)
        if out is None:
            raise ValueError("the block's input has no tokens")
        return out
