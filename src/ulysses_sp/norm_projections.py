"""Linear projections of a tiled norm's output that save the norm's input instead of that output.

A decoder layer's attention projects the input norm's output ``x [b, n, h]`` (q/k/v; MLA: q_a / kv_a), and each
``nn.Linear`` saves ``x`` for its weight gradient: one ``[tokens, hidden]`` tensor held from the layer's
(re)compute to the end of its attention's backward, through the layer's peak. With the norms tiled
(:mod:`ulysses_sp.tiled_norms`) the norm keeps only its input, the residual stream the layer holds anyway.
:class:`NormProjection` (installed on each plain ``nn.Linear`` of a decoder layer) sees when it is called on
exactly the output a tiled norm of its layer has just made; it then saves that norm's input instead of ``x``,
and its backward makes ``x`` again chunk by chunk (the norm's forward under the forward's autocast state) for
the weight gradient. On anything else it is the plain linear. Loss and gradients are those of the plain
projections (the weight gradient summed over chunks in fp32); the cost is one more forward of the norm per
projection in backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .tiling import Replay, TiledForward

__all__ = ["NormProjection", "install_norm_projections", "remove_norm_projections"]


class _ProjectNormOutput(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for ``x = norm(source)``, saving ``source`` (not ``x``)."""

    @staticmethod
    def forward(
        ctx: Any,
        norm: TiledForward,
        x: torch.Tensor,
        source: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.norm, ctx.replay, ctx.x_dtype, ctx.has_bias = norm, Replay(x.device), x.dtype, bias is not None
        ctx.save_for_backward(source, weight, *([bias] if bias is not None else []))
        return F.linear(x, weight, bias)  # under autocast: its casts, as the plain projection's

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        source, weight, *rest = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        need_bias = ctx.has_bias and ctx.needs_input_grad[4]
        grad_x = grad_weight = grad_bias = None
        with ctx.replay():
            on = torch.is_autocast_enabled(grad.device.type)
            dtype = torch.get_autocast_dtype(grad.device.type) if on else ctx.x_dtype  # what F.linear computed in
            g = grad.to(dtype)  # [b, n, out]
            if need_x:
                grad_x = (g @ weight.to(dtype)).to(ctx.x_dtype)  # [b, n, in]
            if need_weight:
                chunk = ctx.norm.chunk_size(source)
                for start in range(0, source.shape[-2], chunk):
                    length = min(chunk, source.shape[-2] - start)
                    with torch.no_grad():
                        x = ctx.norm.call_module(source.narrow(-2, start, length).contiguous()).to(dtype)
                    part = g.narrow(-2, start, length).flatten(0, -2).T @ x.flatten(0, -2)  # [out, in]
                    grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
                grad_weight = grad_weight.to(weight.dtype)
            if need_bias:
                grad_bias = g.flatten(0, -2).sum(0).to(rest[0].dtype)
        return None, grad_x, None, grad_weight, grad_bias


class NormProjection:
    """The ``forward`` installed on one ``nn.Linear``: :class:`_ProjectNormOutput` on the output one of ``norms``
    has just made, the module's own forward on anything else."""

    def __init__(self, module: nn.Linear, norms: list[TiledForward], previous: Callable | None) -> None:
        self.module, self.norms, self.previous = module, norms, previous

    def _source(self, x: torch.Tensor) -> tuple[TiledForward, torch.Tensor] | None:
        for norm in self.norms:
            made = getattr(norm, "made", None)
            if made is not None and made[0]() is x:
                source = made[1]()
                return (norm, source) if source is not None else None
        return None

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        found = self._source(x) if not args and not kwargs and torch.is_grad_enabled() else None
        if found is not None:
            norm, source = found
            return _ProjectNormOutput.apply(norm, x, source, self.module.weight, self.module.bias)
        if self.previous is not None:
            return self.previous(x, *args, **kwargs)
        return nn.Linear.forward(self.module, x, *args, **kwargs)


def record_output(norm: TiledForward, source: torch.Tensor, out: torch.Tensor) -> None:
    """What a tiled norm just made, for the projections of its layer to recognise (weak references)."""
    norm.made = (weakref.ref(out), weakref.ref(source))


def install_norm_projections(layer: nn.Module, norms: list[TiledForward]) -> None:
    """:class:`NormProjection` on every plain ``nn.Linear`` under ``layer`` (not subclasses: LoRA, quantized)."""
    for module in layer.modules():
        if type(module) is nn.Linear and not isinstance(module.__dict__.get("forward"), NormProjection):
            module.forward = NormProjection(module, norms, module.__dict__.get("forward"))


def remove_norm_projections(model: nn.Module) -> None:
    """Undo :func:`install_norm_projections` everywhere in ``model``."""
    for module in model.modules():
        installed = module.__dict__.get("forward")
        if isinstance(installed, NormProjection):
            if installed.previous is not None:
                module.forward = installed.previous
            else:
                del module.forward
