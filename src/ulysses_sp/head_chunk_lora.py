"""LoRA adapters on the projections of a head-chunked attention block (PEFT's ``lora.Linear``).

A LoRA projection computes ``base(x) + sum_a s_a * B_a(A_a(x))`` (``A_a [r, in]``, ``B_a [out, r]``, scaling
``s_a``). Its output rows split by heads as the base layer's do: a chunk's rows are the base weight's rows and
``B``'s same rows, with ``A`` whole, so each chunk computes ``x W_c^T + s (x A^T) B_c^T``; an output projection's
columns split ``A`` by columns and ``B`` stays whole, so the chunks' ``y_c A_c^T`` add up to ``y A^T`` before ``B``.
Gradients: ``B``'s rows (columns of ``A`` for the output projection) from each chunk, ``A``'s (``B``'s) summed
over the chunks (:mod:`ulysses_sp.head_chunk_grads`, :mod:`ulysses_sp.head_chunk_output`).

PEFT is not imported: a projection is taken for a LoRA layer by its attributes (``base_layer``, ``lora_A``,
``lora_B``, ``scaling``). What the chunks cannot compute exactly is refused (:func:`lora_problem`, checked when
the chunks are installed) or, for the state of the call, keeps the unchunked path (:func:`active_adapters`): a LoRA
variant (DoRA and the like), a bias on ``B``, dropout on the adapter's input while training (each chunk would draw
its own mask), adapters per sample (``adapter_names``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Adapter", "active_adapters", "base_linear", "is_lora", "lora_linear", "lora_problem"]


@dataclass(frozen=True)
class Adapter:
    """One active adapter of a projection: ``a`` = A ``[r, in]`` (the parameter), ``b`` = the rows of B ``[out, r]``
    a chunk computes (``b_param``: the parameter), the scaling, and whether the input is cast to A's dtype first
    (PEFT's ``cast_input_dtype_enabled``)."""

    a: torch.Tensor
    b: torch.Tensor
    b_param: torch.Tensor
    scaling: float
    cast: bool

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.a.dtype) if self.cast else x

    def dtype(self, like: torch.dtype) -> torch.dtype:
        """The dtype the adapter computes in for an input of dtype ``like`` (e.g. fp32 adapters of a bf16 layer:
        fp32, as PEFT's forward and its autograd; autocast still casts the matmuls)."""
        return torch.promote_types(like, self.a.dtype) if self.cast else like


def is_lora(child: nn.Module) -> bool:
    """Whether ``child`` is a LoRA layer around a linear one (PEFT's ``lora.Linear``, by its attributes)."""
    return all(isinstance(getattr(child, n, None), nn.Module) for n in ("base_layer", "lora_A", "lora_B")) and (
        isinstance(getattr(child, "scaling", None), dict)
    )


def base_linear(child: nn.Module) -> nn.Module:
    """The linear layer whose weight a projection ``child`` slices: a LoRA layer's base layer, else ``child``."""
    return child.base_layer if is_lora(child) else child


def lora_problem(child: nn.Module) -> str | None:
    """Why a LoRA layer's adapters cannot run in head chunks, whatever the call (None: they can)."""
    if getattr(child, "fan_in_fan_out", False):
        return "it is a LoRA layer with fan_in_fan_out"
    for name, lora_a in child.lora_A.items():
        lora_b = child.lora_B[name]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
            return f"its LoRA adapter {name!r} is not a pair of plain torch.nn.Linear"
        if name in getattr(child, "lora_variant", {}) or getattr(child, "use_dora", {}).get(name):
            return f"its LoRA adapter {name!r} is a variant (DoRA or another), not plain LoRA"
        dropout = child.lora_dropout[name] if name in child.lora_dropout else nn.Identity()
        if type(dropout) not in (nn.Identity, nn.Dropout):
            return f"its LoRA adapter {name!r} has a {type(dropout).__name__} on its input, not torch.nn.Dropout"
        if lora_b.bias is not None:
            return f"its LoRA adapter {name!r} has a bias (lora_bias=True)"
        if lora_a._forward_hooks or lora_a._forward_pre_hooks or lora_b._forward_hooks or lora_b._forward_pre_hooks:
            return f"its LoRA adapter {name!r} has forward hooks, which the chunks would skip"
    return None


def active_adapters(child: nn.Module) -> tuple[Adapter, ...] | str:
    """The adapters that ``child``'s forward adds now (none for a plain layer, a merged or disabled LoRA layer), or
    why this call cannot run in chunks (dropout on the adapter's input while training)."""
    if not is_lora(child) or child.disable_adapters or child.merged:
        return ()
    found = []
    for name in child.active_adapters:
        if name not in child.lora_A:
            continue
        dropout = child.lora_dropout[name] if name in child.lora_dropout else nn.Identity()
        if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
            return (
                f"its LoRA adapter {name!r} drops out its input while training (lora_dropout={dropout.p}), and "
                "the chunks would each draw their own mask; use LoraConfig(lora_dropout=0.0)"
            )
        b = child.lora_B[name].weight
        found.append(
            Adapter(
                child.lora_A[name].weight,
                b,
                b,
                float(child.scaling[name]),
                getattr(child, "cast_input_dtype_enabled", True),
            )
        )
    return tuple(found)


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapters: tuple[Adapter, ...] = ()
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus each adapter's ``s * (x A^T) B^T`` (``adapters``' ``b``: the rows that
    ``weight`` has), in the order and dtypes of PEFT's forward."""
    out = F.linear(x, weight, bias)
    if not adapters:
        return out
    dtype = out.dtype
    for adapter in adapters:
        out = out + F.linear(F.linear(adapter.input(x), adapter.a), adapter.b) * adapter.scaling
    return out.to(dtype)
