"""LoRA adapters on the projections of a head-chunked attention block (PEFT's ``lora.Linear``).

A LoRA projection computes ``base(x) + sum_a s_a * B_a(A_a(x))`` (``A_a [r, in]``, ``B_a [out, r]``, scaling
``s_a``). Its output rows split by heads as the base layer's do: a chunk's rows are the base weight's rows and
``B``'s same rows, with ``A`` whole, so each chunk computes ``x W_c^T + s (x A^T) B_c^T``; an output projection's
columns split ``A`` by columns and ``B`` stays whole, so the chunks' ``y_c A_c^T`` add up to ``y A^T`` before ``B``.
Gradients: ``B``'s rows (columns of ``A`` for the output projection) from each chunk, ``A``'s (``B``'s) summed
over the chunks (:mod:`ulysses_sp.head_chunk_grads`, :mod:`ulysses_sp.head_chunk_output`).

Dropout on an adapter's input (``lora_dropout`` while training) must drop the same elements in every chunk and in
backward: its mask is a function of the call's seed (drawn from torch's generator, as a dropout would advance it) and
each element's position (:class:`~ulysses_sp.dropout_stream.InputDropout`), so any tiling of the tokens (backward
remakes a tiled norm's output tile by tile) sees the same mask, and no mask is stored; its keys are made once per call
(:func:`dropout_keys`). It has ``nn.Dropout``'s law, not its mask (no two runs of dropout agree anyway).

The block's input is projected by every q/k/v chunk: :class:`InputLows` makes its ``dropout(x) A^T`` once per
forward (kept for backward: ``r`` columns each) and A's and the input's gradients once, from the chunks' summed
``s g_c B_c``.

PEFT is not imported: a projection is taken for a LoRA layer by its attributes (``base_layer``, ``lora_A``,
``lora_B``, ``scaling``). What the chunks cannot compute is refused when they are installed (:func:`lora_problem`):
a LoRA variant (DoRA and the like), a bias on ``B``, a dropout module other than ``nn.Dropout``; and per call
(:func:`call_problem`): the same for an adapter added since, hooks on a projection, dropout in a LoRA layer the
chunks do not slice. The adapters are fixed per call, and backward sees the other LoRA layers as the forward did
(:func:`as_in_forward`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dropout_stream import Drawn, InputDropout
from .grad_sums import cast

__all__ = [
    "Adapter",
    "Drawn",
    "InputDropout",
    "InputLows",
    "active_adapters",
    "adapter_seed",
    "as_in_forward",
    "dropout_off",
    "adapter_low",
    "adapter_grads",
    "base_linear",
    "call_problem",
    "dropout_keys",
    "is_lora",
    "lora_linear",
    "lora_problem",
    "unsliced_states",
]


def adapter_seed(call_seed: int, projection: str, index: int, rank: int) -> int:
    """One adapter's :class:`InputDropout` seed: the call's, mixed with the projection, the adapter and the rank."""
    key = zlib.crc32(f"{projection}/{index}/{rank}".encode())
    return ((call_seed ^ (key << 20)) & ((1 << 63) - 1)) - (1 << 62)


@dataclass(frozen=True)
class Adapter:
    """One active adapter of a projection: ``a`` = A ``[r, in]`` (the parameter), ``b`` = the rows of B ``[out, r]``
    a chunk computes (``b_param``: the parameter), the scaling, the dtypes its input is cast to in turn (``casts``:
    PEFT's forward casts one input to each active adapter's A dtype, in their order, and hands each adapter the input
    as cast so far: a bf16 adapter before an fp32 one rounds the fp32 one's input to bf16; empty without PEFT's
    ``cast_input_dtype_enabled``), and the dropout on its input."""

    a: torch.Tensor
    b: torch.Tensor
    b_param: torch.Tensor
    scaling: float
    casts: tuple[torch.dtype, ...]
    p: float = 0.0  # dropout on its input (training only): given an InputDropout per call
    dropout: InputDropout | None = None

    def input(self, x: torch.Tensor) -> torch.Tensor:
        for dtype in self.casts:
            x = cast(x, dtype)
        return x

    def dtype(self, like: torch.dtype) -> torch.dtype:
        """The dtype the adapter computes in for an input of dtype ``like`` (e.g. fp32 adapters of a bf16 layer:
        fp32, as PEFT's forward and its autograd; autocast still casts the matmuls)."""
        return torch.promote_types(like, self.a.dtype) if self.casts else like


def is_lora(child: nn.Module) -> bool:
    """Whether ``child`` is a LoRA layer around a linear one (PEFT's ``lora.Linear``, by its attributes; its
    submodules read from ``_modules``, where a module's are: a missing one costs no AttributeError, and this is asked
    several times per chunk)."""
    found = child._modules
    return (
        isinstance(found.get("lora_A"), nn.Module)  # (first: a plain layer fails here, without a generator's calls)
        and isinstance(found.get("lora_B"), nn.Module)
        and isinstance(found.get("base_layer"), nn.Module)
        and isinstance(getattr(child, "scaling", None), dict)
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
        if any(m._forward_hooks or m._forward_pre_hooks for m in (lora_a, lora_b, dropout)):
            return f"its LoRA adapter {name!r} has forward hooks (lora_A, lora_B or its dropout) the chunks would skip"
    return None


def active_adapters(child: nn.Module) -> tuple[Adapter, ...]:
    """The adapters that ``child``'s forward adds now (none for a plain layer, a merged or disabled LoRA layer), with
    their input's dropout probability where it is active (``lora_dropout`` while training)."""
    if not is_lora(child) or child.disable_adapters or child.merged:
        return ()
    found: list[Adapter] = []
    cast = getattr(child, "cast_input_dtype_enabled", True)
    for name in child.active_adapters:
        if name not in child.lora_A:
            continue
        dropout = child.lora_dropout[name] if name in child.lora_dropout else nn.Identity()
        p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
        a, b = child.lora_A[name].weight, child.lora_B[name].weight
        casts = (*found[-1].casts, a.dtype) if found and cast else (a.dtype,) * cast
        found.append(Adapter(a, b, b, float(child.scaling[name]), casts, p))
    return tuple(found)


def call_problem(module: nn.Module, names: tuple[str, ...]) -> tuple[str, bool] | None:
    """Why this call of ``module`` (projections ``names``) must run its own forward though it can run in chunks,
    and whether that is an error where C > 1 was asked for: a projection's forward hooks now (PEFT's
    ``adapter_names`` adds them for one call), a LoRA adapter added since the chunks were installed (a variant,
    say), dropout in a LoRA layer the chunks do not slice (its forward would run once per chunk, each drawing a
    mask). Merged adapters that are disabled are unmerged first, as PEFT's forward does."""
    sliced = set()
    for name in names:
        wrapper = module._modules[name]
        sliced.add(wrapper)
        if any(m._forward_hooks or m._forward_pre_hooks for m in {wrapper, base_linear(wrapper)}):
            return f"{name} has forward hooks (e.g. PEFT's adapter_names)", False
        if is_lora(wrapper):
            problem = lora_problem(wrapper)
            if problem is not None:
                return f"{name}: {problem}", True
            if wrapper.disable_adapters and wrapper.merged:
                wrapper.unmerge()
    for inner_name, inner in module.named_modules():
        if is_lora(inner) and inner not in sliced and not inner.disable_adapters and not inner.merged:
            active = [name for name in inner.active_adapters if name in inner.lora_A]
            for dropout in (inner.lora_dropout[name] for name in active if name in inner.lora_dropout):
                drops = not isinstance(dropout, nn.Identity) and (not isinstance(dropout, nn.Dropout) or dropout.p > 0)
                if drops and dropout.training:
                    return f"{inner_name}, a LoRA layer the chunks do not slice, drops out its input", True
    return None


def unsliced_states(module: nn.Module, sliced: set[nn.Module]) -> list[tuple[nn.Module, bool, object, tuple]]:
    """The LoRA layers under ``module`` other than ``sliced`` (those run inside the module's own forward, again in
    backward) with their PEFT state: disabled, active adapter(s), merged adapters."""
    return [
        (m, m._disable_adapters, m._active_adapter, tuple(m.merged_adapters))
        for m in module.modules()
        if m not in sliced and is_lora(m) and hasattr(m, "_disable_adapters") and hasattr(m, "_active_adapter")
    ]


@contextlib.contextmanager
def as_in_forward(module: nn.Module, states: list[tuple[nn.Module, bool, object, tuple]]) -> Iterator[None]:
    """Inside the block the LoRA layers the chunks do not slice are as the forward found them (``states``:
    :func:`unsliced_states`; a merge since is an error) and every LoRA input dropout is off (theirs was off in
    forward, or the call ran unchunked; the sliced ones' masks are the chunks' own)."""
    now = [(m, m._disable_adapters, m._active_adapter) for m, *_ in states]
    for m, disabled, active, merged in states:
        if tuple(m.merged_adapters) != merged:
            raise RuntimeError("a LoRA layer was merged or unmerged between a head-chunked forward and its backward")
        m._disable_adapters, m._active_adapter = disabled, active
    try:
        with dropout_off(module):
            yield
    finally:
        for m, disabled, active in now:
            m._disable_adapters, m._active_adapter = disabled, active


@contextlib.contextmanager
def dropout_off(module: nn.Module) -> Iterator[None]:
    """Inside the block, the LoRA layers' input dropouts under ``module`` are in eval mode (off)."""
    found = [d for m in module.modules() if is_lora(m) for d in m.lora_dropout.values() if d.training]
    for dropout in found:
        dropout.eval()
    try:
        yield
    finally:
        for dropout in found:
            dropout.train()


def _spans(adapter: Adapter, t: torch.Tensor, width: int) -> Iterator[tuple[int, int]]:
    """Tiles of the tokens of ``t [rows, n, ...]`` (an adapter's input or its gradient), ``width`` columns wide."""
    if adapter.dropout is None:
        yield 0, t.shape[1]
    else:
        yield from adapter.dropout.spans(t.shape[0], t.shape[1], width, t.device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., n, w]`` as ``[rows, n, w]`` (a view): the tokens are the last dimension but one (the input of a
    projection such as MLA's kv_b_proj is ``[b, 1, n, w]``)."""
    return t.view(-1, t.shape[-2], t.shape[-1]) if t.dim() != 3 else t


def dropout_keys(
    adapter: Adapter, rows: int, length: int, device: torch.device, columns: torch.Tensor | None = None
) -> Drawn | None:
    """The adapter's dropout keys for an input of ``rows`` rows and tokens ``0..length`` (``columns``: A's columns it
    has, None: all), made once per call (:meth:`InputDropout.keys`); None without dropout."""
    if adapter.dropout is None:
        return None
    whole = adapter.dropout.keys(rows, length, adapter.a.shape[1], device)
    return whole if columns is None else whole.select(columns)


def adapter_low(
    adapter: Adapter,
    x: torch.Tensor,
    offset: int = 0,
    columns: torch.Tensor | None = None,
    drawn: Drawn | None = None,
) -> torch.Tensor:
    """``dropout(x) A^T [..., n, r]`` for ``x [..., n, w]`` (its first token is token ``offset``; ``columns``: the
    columns of A that ``x`` has, default all; ``drawn``: the dropout's keys, made already for tokens that include
    ``x``'s), tile by tile under dropout; with ``x``'s graph where grad is on."""
    x = adapter.input(x)
    a = adapter.a if columns is None else adapter.a.index_select(1, columns)
    if adapter.dropout is None:
        return F.linear(x, a)
    x3 = _rows(x.contiguous())  # [rows, n, w]
    drawn = dropout_keys(adapter, x3.shape[0], offset + x3.shape[1], x.device, columns) if drawn is None else drawn
    spans = _spans(adapter, x3, x3.shape[2])
    tiles = [F.linear(drawn.apply(x3.narrow(1, s, n), offset + s), a) for s, n in spans]
    low = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)
    return low.view(*x.shape[:-1], a.shape[0])


class InputLows:
    """The LoRA adapters of the projections of the block's input ``x [b, n, h]`` in one forward or backward:
    ``dropout(x) A^T [b, n, r]`` per (projection, adapter) made once, not once per chunk (:meth:`low`; in backward
    ``lows``, the forward's, where it kept them); in backward the sums over the stages of ``s g_c B_c [b, n, r]``
    (:meth:`add`), from which A's gradient and the input's are made once, in one pass over ``x``'s tiles that draws
    each tile's dropout mask once (:meth:`finish`). ``tiles()``: ``x`` as ``(start, length, tile)`` (whole, or
    remade tile by tile). Each adapter's dropout keys are made once for all of ``x``'s tokens."""

    def __init__(
        self,
        x: torch.Tensor,
        tiles: Callable[[], Iterator[tuple[int, int, torch.Tensor]]],
        lows: dict[tuple[str, int], torch.Tensor] | None = None,
    ) -> None:
        self.x, self.tiles = x, tiles
        self.lows: dict[tuple[str, int], torch.Tensor] = dict(lows or {})
        self.grads: dict[tuple[str, int], tuple[Adapter, torch.Tensor]] = {}

    def drawn(self, adapter: Adapter) -> Drawn | None:
        """The adapter's dropout keys over all of ``x``'s tokens (None: no dropout)."""
        return dropout_keys(adapter, math.prod(self.x.shape[:-2]), self.x.shape[-2], self.x.device)

    def low(self, name: str, index: int, adapter: Adapter) -> torch.Tensor:
        key = (name, index)
        if key not in self.lows:
            drawn = self.drawn(adapter)
            with torch.no_grad():
                parts = [adapter_low(adapter, tile, start, drawn=drawn) for start, _, tile in self.tiles()]
            self.lows[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        return self.lows[key]

    def add(self, name: str, index: int, adapter: Adapter, low_grad: torch.Tensor) -> None:
        """Add a stage's ``s g_c B_c [b, n, r]`` (the gradient of :meth:`low`'s output)."""
        key = (name, index)
        if key in self.grads:
            self.grads[key][1].add_(low_grad)
        else:
            self.grads[key] = (adapter, cast(low_grad, torch.promote_types(low_grad.dtype, torch.float32)))

    def finish(self, a_sum: Callable[[Adapter], torch.Tensor | None], x_sum: Callable[[], torch.Tensor | None]) -> None:
        """A's gradients ``G^T dropout(x)`` into ``a_sum(adapter)`` (None: not wanted) and the input's
        ``dropout'(G A)`` into ``x_sum()`` (None: not wanted), tile by tile; then forget the sums."""
        grads = [(adapter, total, self.drawn(adapter)) for adapter, total in self.grads.values()]
        self.grads = {}
        if not grads:
            return
        target = x_sum()
        for start, length, tile in self.tiles():  # [b, length, h]
            for adapter, total, drawn in grads:
                g, a_target = total.narrow(1, start, length), a_sum(adapter)
                adapter_grads(adapter, g, tile, start, a_target=a_target, x_target=target, x_start=start, drawn=drawn)


def adapter_grads(
    adapter: Adapter,
    low_grad: torch.Tensor,
    x: torch.Tensor | None,
    offset: int = 0,
    columns: torch.Tensor | None = None,
    *,
    a_target: torch.Tensor | None = None,
    x_target: torch.Tensor | None = None,
    x_start: int = 0,
    drawn: Drawn | None = None,
) -> None:
    """For the gradient ``low_grad [..., n, r]`` of :func:`adapter_low`'s output (``x [..., n, w]``, its first token
    token ``offset``; ``columns``: A's columns that ``x`` has, default all; ``drawn``: as for :func:`adapter_low`):
    A's gradient ``low_grad^T dropout(x)`` into ``a_target [r, w]`` and the input's ``dropout'(low_grad A)`` into
    ``x_target``'s tokens from ``x_start`` (each None: not wanted; ``x`` is read only for A's), tile by tile, each
    tile's dropout mask drawn once."""
    dtype = adapter.dtype(low_grad.dtype)
    a = cast(adapter.a if columns is None else adapter.a.index_select(1, columns), dtype)  # [r, w]
    low_grad = _rows(low_grad.contiguous())  # [rows, n, r]
    x = None if a_target is None else _rows(adapter.input(x).contiguous())  # [rows, n, w]
    target = None if x_target is None else _rows(x_target)
    if drawn is None:
        drawn = dropout_keys(adapter, low_grad.shape[0], offset + low_grad.shape[1], low_grad.device, columns)
    for start, length in _spans(adapter, low_grad, a.shape[1]):
        g = cast(low_grad.narrow(1, start, length), dtype)  # [rows, length, r]
        keep = None if drawn is None else drawn.keep(offset + start, length)  # [rows, length, w]
        if x is not None:
            tile = cast(x.narrow(1, start, length), dtype)
            tile = tile if keep is None else drawn.apply(tile, offset + start, keep)
            grad = g.reshape(-1, g.shape[-1]).t() @ tile.reshape(-1, tile.shape[-1])  # [r, w]
            a_target.add_(cast(grad, a_target.dtype))
        if target is not None:
            grad = g @ a  # [rows, length, w]
            target.narrow(1, x_start + start, length).add_(grad if keep is None else drawn.apply(grad, 0, keep))


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    adapters: tuple[Adapter, ...] = (),
    offset: int = 0,
    lows: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus each adapter's ``s * (dropout(x) A^T) B^T`` (``adapters``' ``b``: the rows
    that ``weight`` has; ``offset``: the token of ``x``'s first, for the dropout; ``lows``: the adapters'
    ``dropout(x) A^T`` where made already), in the order and dtypes of PEFT's forward."""
    out = F.linear(x, weight, bias)
    if not adapters:
        return out
    if lows is None:
        lows = [adapter_low(adapter, x, offset) for adapter in adapters]
    dtype = out.dtype
    for adapter, low in zip(adapters, lows, strict=True):
        out = out + F.linear(low, adapter.b) * adapter.scaling
    return cast(out, dtype)
