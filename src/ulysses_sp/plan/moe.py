"""A mixture-of-experts layer's MLP terms of the memory model, and the sizes they are read from.

The sparse MoE block as transformers runs it (the experts' default ``grouped_mm`` path; the ``eager`` loop over the
experts saves the same tensors): the router scores the T tokens and picks k experts for each; the S = T k (token,
expert) rows are gathered in expert order (``x_g [S, h]``), go through the experts' fused gate/up projection
(``[S, 2I]``), the activation and the gated product (``[S, I]`` each) and the down projection (``[S, h]``), are
multiplied by the router's top-k weights (in the weights' dtype: fp32 where the router returns them in fp32, as
Mixtral's does), put back in token order and summed per token. Autograd keeps x_g, the gate/up output, the activation,
the product and the down projection's output: ``c k (2h + 4I)`` bytes per token, next to the router's (its
probabilities, its indices: measured on the router itself, :func:`moe_shape`), the three index tensors of the
permutation and a shared expert's (a gated MLP; Qwen2-MoE's sigmoid gate keeps that expert's output too).

Its backward peaks at one of two moments (measured with a tracker of live tensors, ``plan --simulate`` on the CPU):
at its start, where the weighted rows' gradient exists three times (the sum's, the zeros the permutation's
gradient fills, the filled copy) on top of everything saved; or where the gate/up weights' gradient is made (all
the experts' gradients exist then). Tiled (:mod:`ulysses_sp.tiling`), each chunk of tokens is recomputed and
back-propagated with autograd and the parameters' gradients are summed over the chunks in fp32 (all the experts'),
one gradient of the chunk alive at a time.

Notation as in :mod:`ulysses_sp.plan.memory`; k = experts per token, I = one expert's width, Is = the shared
experts' width, E = experts, w = bytes of the weighted rows (4 where the router's weights are fp32, else c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoeShape", "has_experts", "moe_saved", "moe_shape", "moe_terms"]

_PROBE_TOKENS = (8, 16)  # the router's saved bytes per token: the difference between these two calls


@dataclass(frozen=True)
class MoeShape:
    """The sizes of a model's MoE blocks the memory model needs (read from the model built on the meta device)."""

    experts: int  # E
    per_token: int  # k
    width: int  # I: one expert's MLP width
    shared_width: int  # Is: the shared experts' width together (0: none)
    shared_gate: bool  # a sigmoid gate on the shared expert's output, which it saves (Qwen2-MoE)
    block_params: int  # parameters of one MoE block (experts, router, shared experts)
    largest_param: int  # its largest parameter (the experts' gate/up): tiled, one gradient of it at a time
    router_saved: tuple[float, float]  # bytes per token the router saves (bf16 autocast, fp32)
    fp32_weights: bool  # the router's top-k weights are fp32 under bf16 autocast: the weighted rows are fp32
    sparse: tuple[bool, ...]  # per decoder layer: an MoE block (else a dense gated MLP dense_width wide)
    dense_width: int


def moe_saved(moe: MoeShape, *, h: int, c: int) -> float:
    """Bytes per token one MoE block saves for backward (untiled)."""
    k, w = moe.per_token, _weights_bytes(moe, c)
    router = moe.router_saved[c == 4] + 3 * 8 * k + w * k  # + the permutation's int64 indices, the sorted weights
    routed = c * k * (2 * h + 4 * moe.width)  # x_g [S, h], gate/up [S, 2I], act and product [S, I], down [S, h]
    return router + routed + _shared_saved(moe, h=h, c=c)


def moe_terms(
    moe: MoeShape, *, h: int, c: int, u: int, t: int, chunk: int, tiled: bool, fused_norm: bool, fsdp: bool
) -> tuple[float, float, float]:
    """``(saved, backward, grads)`` of the last layer's MoE block as :mod:`ulysses_sp.plan.memory` counts a gated MLP:
    bytes per local token saved (0 tiled) and of its backward's working set above them (tiled: or of its recompute's
    forward, no input gradient yet), and the bytes of its unsharded parameters' gradients held then (untiled FSDP2).
    ``t`` tokens on this rank, ``chunk`` tokens per tile, ``fused_norm``: the tiled norm runs inside each chunk."""
    k, w, i = moe.per_token, _weights_bytes(moe, c), moe.width
    saved = moe_saved(moe, h=h, c=c)
    extras = saved - c * k * (2 * h + 4 * i)  # the router's, the permutation's and the shared expert's
    # At the start of the routed rows' backward: their gradient, as the sum's, the zeros of the permutation's gradient
    # and their filled copy [S, h]. A shared expert computed after the routed ones (DeepSeek) is back-propagated
    # first: its saved tensors are gone, its input's gradient made; one computed before them (Qwen2-MoE) still holds
    # its saved tensors: the larger of the two.
    shared = _shared_saved(moe, h=h, c=c)
    start = saved + 3 * k * h * w + (max(0, c * h - shared) if moe.shared_width else 0)
    # while the gate/up's weight gradient is made: x_g, the gate/up output's and x_g's gradients are left
    late = extras + c * k * (2 * h + 2 * i)
    if not tiled:  # (both moments precede the block's input gradient, which memory.py's gradient stream counts)
        grads = c * moe.block_params if fsdp else 0  # all the experts' gradients, made by then
        if late * t + grads > start * t:
            return saved, late - saved - c * h, grads
        return saved, start - saved - c * h, 0
    # Tiled, per chunk of T tokens: the fused norm's fp32 input (bf16) and its two outputs, the chunk's output (the
    # previous chunk's input gradient is freed before the next is made: ulysses_sp.tiling); the parameters' fp32 sums
    # over the chunks (from the second chunk on), and one of a chunk's parameter gradients at a time. One chunk: no
    # input gradient buffer (the chunk's own gradient, made at its end), its gradients kept as they are made (those
    # of the experts' down projection, then the gate/up's).
    chunks = -(-t // chunk)
    norm = (u + 2 * c) * h if fused_norm else 0
    around = (norm + c * h) * chunk
    sums = 4 * moe.block_params if chunks > 1 else 0
    made = sums or c * (moe.block_params - moe.largest_param)
    backward = max(sums + around + start * chunk, made + around + late * chunk + c * moe.largest_param)
    backward -= c * h * t if chunks == 1 else 0  # memory.py's gradient stream counts the input gradient's buffer
    # its forward (the recompute's): x_g, gate/up, act and product at once, or x_g, down's output, the weighted rows
    # and their un-permuted copy; a shared expert's output; the output buffer of several chunks; no input gradient
    rows = k * max(c * (h + 4 * i), 2 * c * h + 2 * w * h) + extras + (c * h if moe.shared_width else 0)
    forward = (norm + rows) * chunk + (c * h * t if chunk < t else 0) - c * h * t
    return 0.0, max(backward, forward) / t, 0


def _shared_saved(moe: MoeShape, *, h: int, c: int) -> int:
    """Bytes per token a shared expert saves: a gated MLP's four [T, Is] (and its output, where a gate scales it)."""
    return 4 * c * moe.shared_width + (c * h if moe.shared_gate else 0)


def _weights_bytes(moe: MoeShape, c: int) -> int:
    return 4 if c < 4 and moe.fp32_weights else c


def has_experts(layers: list[Any]) -> bool:
    """Whether any decoder layer's MLP holds experts (a child ``experts``)."""
    from ..hf import layer_mlp

    return any(mlp is not None and mlp._modules.get("experts") is not None for mlp in map(layer_mlp, layers))


def moe_shape(text: Any, layers: list[Any], *, per_token: int, width: int, shared: int, dense: int) -> MoeShape | None:
    """The :class:`MoeShape` of a model (built on the meta device; ``layers`` its decoder layers) or None where no
    layer holds an MoE block as transformers 5 builds them: a child ``experts`` whose weights are ``[E, ...]``
    tensors (not a list of expert modules), beside a router whose weight is ``[E, h]``."""
    from ..hf import layer_mlp

    blocks = []
    for mlp in map(layer_mlp, layers):
        experts = mlp._modules.get("experts") if mlp is not None else None
        blocks.append(mlp if experts is not None and any(p.dim() == 3 for p in experts.parameters()) else None)
    found = [block for block in blocks if block is not None]
    if not found:
        return None
    block = found[-1]
    params = list(block.parameters())
    experts = next(p.shape[0] for p in block._modules["experts"].parameters() if p.dim() == 3)
    routers = [m for name, m in block.named_children() if name != "experts"]
    router = next((m for m in routers if _weight_shape(m) == (experts, text.hidden_size)), None)  # weight [E, h]
    router_saved, fp32_weights = _probe_router(router, text.hidden_size, experts, per_token)
    return MoeShape(
        experts=experts,
        per_token=per_token,
        width=width,
        shared_width=shared,
        shared_gate=block._modules.get("shared_expert_gate") is not None,
        block_params=sum(p.numel() for p in params),
        largest_param=max(p.numel() for p in params),
        router_saved=router_saved,
        fp32_weights=fp32_weights,
        sparse=tuple(block is not None for block in blocks),
        dense_width=dense,
    )


def _weight_shape(module: Any) -> tuple[int, ...] | None:
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if weight is not None else None


def _probe_router(router: Any, hidden: int, experts: int, per_token: int) -> tuple[tuple[float, float], bool]:
    """What ``router`` (on the meta device) saves per token under bf16 autocast and in fp32, and whether its top-k
    weights (its output's second tensor) come back in fp32 under bf16: a copy of it run on a few tokens on the CPU
    (its weight is E x h), its saved tensors counted as autograd packs them (the input and its parameters left out).
    Where it cannot run: fp32 probabilities and indices, fp32 weights."""
    import copy

    import torch

    from ..memory import SavedActivations

    fallback = ((4 * experts + 8 * per_token,) * 2, True)
    if router is None:
        return fallback
    try:
        probe = copy.deepcopy(router).to_empty(device="cpu")
        with torch.no_grad():
            for tensor in [*probe.parameters(), *probe.buffers()]:
                tensor.zero_()
        found, fp32_weights = [], True
        for dtype in (torch.bfloat16, torch.float32):
            counts = []
            for tokens in _PROBE_TOKENS:
                x = torch.zeros(tokens, hidden, dtype=dtype, requires_grad=True)
                bf16 = dtype == torch.bfloat16
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), SavedActivations(probe, (x,)) as saved:
                    out = probe(x)
                counts.append(saved.bytes)
                if bf16 and isinstance(out, tuple | list) and len(out) > 1 and isinstance(out[1], torch.Tensor):
                    fp32_weights = out[1].dtype == torch.float32
            found.append((counts[1] - counts[0]) / (_PROBE_TOKENS[1] - _PROBE_TOKENS[0]))
        return (found[0], found[1]), fp32_weights
    except Exception:  # noqa: BLE001 (any router this cannot run: the fallback's figures stand in)
        return fallback
