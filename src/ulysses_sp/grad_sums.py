"""Parameter gradients summed over the chunks of a tiled module (:mod:`ulysses_sp.tiling`) as autograd makes them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["GradSums", "add_mm", "cast", "sum_dtype"]


def sum_dtype(dtype: torch.dtype, wide: bool) -> torch.dtype:
    """The dtype of a sum of ``dtype`` gradients: fp32 for 16-bit ones when ``wide`` (summed over several parts)."""
    return torch.float32 if wide and dtype in (torch.bfloat16, torch.float16) else dtype


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, not called where ``t`` has that dtype (``.to`` then returns ``t`` as well, after ~1 us in the
    dispatcher: a head-chunked step asks ~250 times, most of them already in the dtype)."""
    return t if t.dtype == dtype else t.to(dtype)


def add_mm(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target += a @ b``, in place where the dtypes allow (no product tensor), else through one product."""
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    else:
        target.add_(a.mm(b))


class GradSums:
    """Each parameter's gradient summed over the chunks AS autograd makes it (a hook on the parameter while the
    chunks run), so that one chunk's parameter gradient lives only until it is added: the sums plus one
    parameter-sized gradient at a time, not the sums plus all of a chunk's (the ``torch.autograd.grad`` call
    then captures a zero-strided stand-in). Sums are fp32 for bf16/fp16 parameters when there is more than one
    chunk. A parameter that receives a gradient twice in one chunk is one that a graph outside this module
    also uses while its chunks run, which the hook could not tell apart: a RuntimeError, never a wrong sum."""

    def __init__(self, params: list[torch.Tensor], *, wide: bool) -> None:
        self.params, self.wide = params, wide
        self.sums: list[torch.Tensor | None] = [None] * len(params)
        self.calls = [0] * len(params)
        self.handles: list[Any] = []

    def _hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(grad: torch.Tensor) -> torch.Tensor:
            self.calls[i] += 1
            total = self.sums[i]
            if total is None:
                if sum_dtype(grad.dtype, self.wide) != grad.dtype:
                    self.sums[i] = grad.float()
                else:  # kept and added to in place: not a view of, or a broadcast into, what autograd holds
                    owned = grad._base is None and grad.is_contiguous()
                    self.sums[i] = grad if owned else grad.clone(memory_format=torch.contiguous_format)
            else:
                total.add_(grad)
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

        return add

    def _sum(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s sum (made zero on first use), or None when ``param`` is not one whose gradient is wanted."""
        i = next((i for i, p in enumerate(self.params) if p is param), None)
        if i is None:
            return None
        if self.sums[i] is None:
            self.sums[i] = torch.zeros(param.shape, dtype=sum_dtype(param.dtype, self.wide), device=param.device)
        return self.sums[i]

    def add_mm(self, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add ``a @ b`` to ``param``'s sum, a gradient made by hand (no hook runs; skipped if not wanted)."""
        total = self._sum(param)
        if total is not None:
            add_mm(total, a, b)

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``param``'s sum, a gradient made by hand (no hook runs; skipped if not wanted)."""
        total = self._sum(param)
        if total is not None:
            total.add_(grad)

    def cast(self) -> Iterator[torch.Tensor | None]:
        """The sums in order, each in its parameter's dtype and dropped from here once cast (an fp32 sum is freed
        before the next one is cast: the casts are not all held next to the sums)."""
        for i, param in enumerate(self.params):
            total, self.sums[i] = self.sums[i], None
            yield None if total is None else total.to(param.dtype)

    def check_chunk(self) -> None:
        if any(n > 1 for n in self.calls):
            names = [tuple(p.shape) for p, n in zip(self.params, self.calls, strict=True) if n > 1]
            raise RuntimeError(
                f"parameters of shapes {names} received more than one gradient while one chunk of a tiled module "
                "was back-propagated: they are also used outside it in the same backward; disable the tiling"
            )
        self.calls = [0] * len(self.params)

    def __enter__(self) -> GradSums:
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
