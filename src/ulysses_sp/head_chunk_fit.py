"""Which parts of an attention module head chunks can split by heads, and what to name when they cannot.

The chunks slice the module's projections by heads, found by name (``q_proj`` / ``k_proj`` / ``v_proj`` /
``o_proj``, MLA's ``q_b_proj`` / ``kv_b_proj``), and run its per-head q/k norms on each chunk's heads. A q/k norm
over every head's features at once (OLMo-2's ``q_norm`` of width heads x head dim) needs the whole projection: refused
before any step. Other parts with weights (an output gate such as AFMoE's ``gate_proj``, a norm over the whole output
such as BitNet's ``attn_sub_norm``, DiffLlama's ``lambda_*``) are left to the first call's probe, which names them
when the chunked forward fails or differs (:mod:`ulysses_sp.head_chunk_probe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Projections", "norm_problem", "projection_names", "unsliced_parts"]

QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
# what the chunks run or leave alone besides the projections: per-head norms, MLA's low-rank parts before the split
_KNOWN = (*QK_NORMS, "v_norm", "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


@dataclass(frozen=True)
class Projections:
    """The names of a module's projections: sliced by query heads (rows), by kv heads (rows), the output (columns)."""

    query: tuple[str, ...]
    kv: tuple[str, ...]
    out: str


def projection_names(module: nn.Module) -> Projections | str:
    """``module``'s projections, or why it has none the chunks recognise (naming the ones it lacks)."""
    children = module._modules
    query = next(((n,) for n in ("q_proj", "q_b_proj") if children.get(n) is not None), None)
    kv = ("k_proj", "v_proj") if children.get("k_proj") is not None else ("kv_b_proj",)
    if query is None or any(children.get(n) is None for n in kv) or children.get("o_proj") is None:
        mla = children.get("kv_b_proj") is not None
        wanted = (*(query or ("q_proj",)), *(("kv_b_proj",) if mla else ("k_proj", "v_proj")), "o_proj")
        missing = [n for n in wanted if children.get(n) is None]
        present = sorted(n for n, m in children.items() if m is not None)
        return (
            f"it has no {'/'.join(missing)} child (the chunks find the projections they slice by the names "
            f"q_proj/k_proj/v_proj/o_proj, or MLA's q_b_proj/kv_b_proj; its children are {present})"
        )
    return Projections(query, kv, "o_proj")


def norm_problem(module: nn.Module) -> str | None:
    """A q/k norm of ``module`` over more than one head's features (OLMo-2's ``q_norm``: heads x head dim), which one
    chunk of heads cannot apply (None: its q/k norms, if any, are per head)."""
    head_dim = getattr(module, "head_dim", None)
    for name in QK_NORMS:
        weight = getattr(module._modules.get(name), "weight", None)
        if isinstance(head_dim, int) and isinstance(weight, torch.Tensor) and weight.numel() > head_dim:
            width = weight.numel()
            return (
                f"its {name} normalises {width} features at once ({width // head_dim} heads x {head_dim}, not one "
                "head's), which needs every head's projection, not one chunk's"
            )
    return None


def unsliced_parts(module: nn.Module, names: Projections) -> list[str]:
    """The children with weights and the own parameters of ``module`` that the chunks neither slice nor run per head
    (an output gate, a norm over all heads' output, per-module scalars): what a failed probe names."""
    known = {*names.query, *names.kv, names.out, *_KNOWN}
    children = [n for n, m in module.named_children() if n not in known and next(m.parameters(), None) is not None]
    return sorted(children + [n for n, _ in module.named_parameters(recurse=False)])
