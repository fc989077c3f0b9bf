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

from .compile_boundary import TILED_OFF, run_eagerly
from .instance_forward import install_forward, installed_forward, restore_forward
from .replay import Replay
from .tiled_op import AVAILABLE
from .tiling import TiledForward, _spans, compute_dtype

__all__ = ["NormProjection", "install_norm_projections", "remove_norm_projections"]


class _ProjectNormOutput(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for ``x = norm(source)``, saving ``source`` (not ``x``)."""

    @staticmethod
    def forward(
        ctx: Any,
        made: _Made,
        x: torch.Tensor,
        source: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.dtype = compute_dtype(x)  # what F.linear computes in
        ctx.norm, ctx.replay, ctx.x_dtype, ctx.has_bias = made.norm, made.replay, x.dtype, bias is not None
        ctx.save_for_backward(source, weight, *([bias] if bias is not None else []))
        return F.linear(x, weight, bias)  # under autocast: its casts, as the plain projection's

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        source, weight, *rest = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        need_bias = ctx.has_bias and ctx.needs_input_grad[4]
        grad_x = grad_weight = grad_bias = None
        g = grad.to(ctx.dtype)  # [b, n, out]
        if need_x:
            grad_x = (g @ weight.to(ctx.dtype)).to(ctx.x_dtype)  # [b, n, in]
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start, length in _spans(source.shape[-2], ctx.norm.chunk_size(source)):
                with torch.no_grad(), ctx.replay():  # the norm as it ran in forward (its autocast state)
                    x = ctx.norm.call_module(source.narrow(-2, start, length).contiguous()).to(ctx.dtype)
                grad_weight.add_(g.narrow(-2, start, length).flatten(0, -2).T @ x.flatten(0, -2))  # [out, in]
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = g.flatten(0, -2).sum(0).to(rest[0].dtype)
        return None, grad_x, None, grad_weight, grad_bias


class _Made:
    """What a tiled norm just made: weak references to its output and input, their versions (an in-place change
    of either after the norm makes the output unrecognised) and the norm's autocast and RNG state."""

    __slots__ = ("norm", "out", "out_version", "replay", "source", "source_version")

    def __init__(self, norm: TiledForward, source: torch.Tensor, out: torch.Tensor) -> None:
        self.norm, self.replay = norm, Replay(out.device)
        self.out, self.out_version = weakref.ref(out), out._version
        self.source, self.source_version = weakref.ref(source), source._version

    def source_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm's input if ``x`` is its unchanged output and that input is unchanged too, else None."""
        source = self.source()
        if self.out() is not x or x._version != self.out_version or x.shape[-2] == 0 or source is None:
            return None
        return source if source._version == self.source_version else None


class NormProjection:
    """The ``forward`` installed on one ``nn.Linear``: :class:`_ProjectNormOutput` on the output one of ``norms``
    has just made, the module's own forward on anything else."""

    def __init__(self, module: nn.Linear, norms: list[TiledForward], previous: Callable | None) -> None:
        self.module, self.norms, self.previous = module, norms, previous

    @property
    def plain_on_chunks(self) -> bool:
        """True when a call on anything but a tiled norm's output (a chunk of a tiled MLP) is the plain linear, so
        that :mod:`ulysses_sp.gated_tile` may compute it with ``F.linear``: no other library's forward under it."""
        return self.previous is None

    def _made(self, x: torch.Tensor) -> tuple[_Made, torch.Tensor] | None:
        if type(self.module.weight) is not nn.Parameter:  # a tensor subclass (quantized, DTensor): its own path
            return None
        return self.made_by_norm(x)

    def made_by_norm(self, x: torch.Tensor) -> tuple[_Made, torch.Tensor] | None:
        """What made ``x`` and the norm's input, where ``x`` is the unchanged output one of ``norms`` has just made."""
        for norm in self.norms:
            made = getattr(norm, "made", None)
            source = made.source_of(x) if made is not None else None
            if source is not None:
                return made, source
        return None

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if AVAILABLE and torch.compiler.is_compiling():  # traced: the plain projection (see compile_boundary)
            return self.plain(x, *args, **kwargs)
        return self.eager_call(x, *args, **kwargs)

    @run_eagerly("runs the tiled MLP and norms eagerly (their chunks are recomputed in backward by hand)", TILED_OFF)
    def eager_call(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        found = self._made(x) if not args and not kwargs and torch.is_grad_enabled() else None
        if found is not None:
            made, source = found
            return _ProjectNormOutput.apply(made, x, source, self.module.weight, self.module.bias)
        return self.plain(x, *args, **kwargs)

    def plain(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.previous is not None:
            return self.previous(x, *args, **kwargs)
        return nn.Linear.forward(self.module, x, *args, **kwargs)


def record_output(norm: TiledForward, source: torch.Tensor, out: torch.Tensor) -> None:
    """What a tiled norm just made, for the projections of its layer to recognise (:class:`_Made`)."""
    norm.made = _Made(norm, source, out) if torch.is_grad_enabled() else None


def install_norm_projections(layer: nn.Module, norms: list[TiledForward]) -> None:
    """:class:`NormProjection` on every plain ``nn.Linear`` under ``layer`` (not subclasses: LoRA, quantized)."""
    for module in layer.modules():
        previous = installed_forward(module)
        if type(module) is nn.Linear and not isinstance(previous, NormProjection):
            install_forward(module, NormProjection(module, norms, previous))


def remove_norm_projections(model: nn.Module) -> None:
    """Undo :func:`install_norm_projections` everywhere in ``model``."""
    for module in model.modules():
        installed = installed_forward(module)
        if isinstance(installed, NormProjection):
            restore_forward(module, installed.previous)
