"""The ``flash_attention_2`` / ``flash_attention_3`` cores: flash-attn's kernels (CUDA only), whole rows with
``flash_attn_func`` and packed or padded rows with ``flash_attn_varlen_func`` fed with ``cu_seqlens``.
:func:`ulysses_sp.cores.get_core` checks that the package imports and a GPU exists before one is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cores import Segments

__all__ = ["FLASH_MODULES", "flash_core"]

# core name -> the package whose kernels it calls
FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def flash_core(module_name: str) -> Callable[..., torch.Tensor]:
    """The core that calls the flash kernels of package ``module_name`` (see :data:`FLASH_MODULES`)."""

    def core(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Segments,
        *,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        flash = importlib.import_module(module_name)
        kwargs = {"softmax_scale": scaling, "causal": True}
        kwargs["window_size"] = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        if softcap is not None:
            kwargs["softcap"] = softcap
        if dropout:
            if module_name != "flash_attn":
                raise ValueError(f"{module_name} has no attention dropout (dropout={dropout}); use flash_attention_2")
            kwargs["dropout_p"] = dropout
        b, h, seq_len, d = q.shape
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, N, heads, d]
        if segments.is_dense:
            out = flash.flash_attn_func(qt, kt, vt, **kwargs)
            return out[0] if isinstance(out, tuple) else out
        index, cu, max_len = segments.varlen()
        flat = [x.reshape(b * seq_len, x.shape[2], d) for x in (qt, kt, vt)]  # [b*N, heads, d]
        padded = index.numel() != b * seq_len
        if padded:  # keep real tokens only
            flat = [x.index_select(0, index) for x in flat]
        out = flash.flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, **kwargs)
        out = out[0] if isinstance(out, tuple) else out  # [T, h, d]
        if padded:
            out = out.new_zeros(b * seq_len, h, d).index_copy(0, index, out)
        return out.reshape(b, seq_len, h, d)

    core.__name__ = f"flash_core_{module_name}"
    return core
