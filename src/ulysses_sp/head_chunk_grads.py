"""The head-chunked block's backward sums: what each chunk's projections add to the input's and the parameters'
gradients (:class:`Accumulators`), and the cut that lets the projections of the block's input run their backward by
hand (:class:`ProjectionCut`), in place into those sums.

Used by :mod:`ulysses_sp.head_chunk_pipeline` (its backward) and :mod:`ulysses_sp.head_chunks` (the sliced
projections, which tap their outputs during backward's re-projection).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge

from .grad_sums import add_mm, cast, sum_dtype
from .head_chunk_lora import lora_linear

if TYPE_CHECKING:
    from .deferred_input import NormRemake
    from .head_chunk_lora import Adapter
    from .head_chunk_parts import ChunkParts
    from .head_chunk_pipeline import ChunkRun

__all__ = ["Accumulators", "ProjectionCut", "Roots"]


class Roots:
    """What one stage sent of its projected q/k/v (None for what it did not) as autograd reaches them (their gradient
    edges), with their head counts and dtypes: the tensors themselves are not kept, so they are freed as soon as
    their exchange has copied them (each is ``[b, heads, n, d]``; holding them until the chunk's gradients came back
    cost ~1.5/C ``[t, h]`` per chunk alive). A tensor that does not require grad (frozen projections of an input that
    needs none) has no edge and receives no gradient. ``retain``: keep the graph through :meth:`backward` (another
    backward from the same capture follows: the shared kv heads projected with chunk 0's queries)."""

    def __init__(
        self, q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, *, retain: bool = False
    ) -> None:
        self.retain = retain
        # (lists made into tuples, not generators: this runs per chunk and stage)
        self.heads = tuple([0 if t is None else t.shape[1] for t in (q, k)])  # query heads, kv heads sent
        self.dtypes = tuple([None if t is None else t.dtype for t in (q, k, v)])
        self.edges = tuple([get_gradient_edge(t) if t is not None and t.requires_grad else None for t in (q, k, v)])

    def backward(
        self, grads: tuple[torch.Tensor | None, ...], inputs: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, ...]:
        """``torch.autograd.grad`` from these roots (``grads``: one per root, in its dtype) to ``inputs``."""
        pairs = [(edge, grad) for edge, grad in zip(self.edges, grads, strict=True) if edge is not None]
        if not pairs:
            return (None,) * len(inputs)
        edges, wanted = zip(*pairs, strict=True)
        return torch.autograd.grad(list(edges), inputs, list(wanted), allow_unused=True, retain_graph=self.retain)


class ProjectionCut:
    """Backward's cut of the sliced projections applied to the block's input ``x`` itself.

    Each such output is computed without a graph and handed on through :class:`_Tap`, whose backward gives its
    gradient to ``sink(name, x, grad)``: there the projection's backward runs as matmuls added in place into the
    chunk sums (``ChunkRun``'s accumulators), so autograd never holds the three ``[t, h]`` input gradients and
    their sum at once, and each output gradient is freed as soon as it has been used. ``anchor``: an empty leaf
    that every tap hangs from, to name in ``torch.autograd.grad``'s inputs so that the taps run. ``remake`` /
    ``source``: how the tiled norm that made ``x`` remakes it, and from what, where ``x`` is
    :class:`~ulysses_sp.deferred_input.Absent` (the module reads its input only through the cut projections, so
    nothing else reaches it).
    """

    def __init__(self, x: torch.Tensor, remake: NormRemake | None = None, source: torch.Tensor | None = None) -> None:
        self.x, self.remake, self.source = x, remake, source
        self.anchor = torch.empty(0, device=x.device, requires_grad=True)
        self.sink: Callable[[str, ProjectionCut, torch.Tensor], None] | None = None
        self.count = 0  # projections cut

    @property
    def remade(self) -> bool:
        """Whether ``x`` is remade from the norm's input (it is then an :class:`Absent`)."""
        return self.remake is not None and self.source is not None

    def project(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        adapters: tuple[Adapter, ...] = (),
        lows: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (plus LoRA ``adapters``; ``lows``: their ``dropout(x) A^T [b, n, r]``, made
        already) without a graph, under the caller's autocast state; tile by tile from the norm's input where ``x``
        is :class:`~ulysses_sp.deferred_input.Absent`."""

        def linear(x: torch.Tensor, start: int = 0) -> torch.Tensor:
            tiles = None if lows is None else [low.narrow(-2, start, x.shape[-2]) for low in lows]
            return lora_linear(x, weight, bias, adapters, start, tiles)

        if self.remade:
            return self.remake.project(self.source, linear)
        with torch.no_grad():
            return linear(self.x)

    def tiles(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``x`` as ``(start, length, tile [b, length, h])``: one tile, or remade tile by tile from the norm's input."""
        if not self.remade:
            yield 0, self.x.shape[-2], self.x
            return
        yield from self.remake.tiles(self.source)

    def tap(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``name``'s projection of ``x``, computed without a graph) with its gradient going to the sink."""
        self.count += 1
        return _Tap.apply(out, self.anchor, self, name)

    def deliver(self, name: str, grad: torch.Tensor) -> None:
        if self.sink is None:
            raise RuntimeError("a cut projection was differentiated outside the chunk's backward")
        self.sink(name, self, grad)


class _Tap(torch.autograd.Function):
    """Identity on a projection's output; its backward hands the gradient to the cut's sink (nothing flows on)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, anchor: torch.Tensor, cut: ProjectionCut, name: str) -> torch.Tensor:
        ctx.cut, ctx.name = cut, name
        return out.view_as(out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.cut.deliver(ctx.name, grad)
        return None, None, None, None


_INPUT = "<the block's input>"  # add_chunk's name for the input's gradient (not a projection's)


def _zeros(t: torch.Tensor, chunks: int) -> torch.Tensor:
    """A zeroed accumulator of ``t``'s shape (:func:`ulysses_sp.grad_sums.sum_dtype`)."""
    return torch.zeros(t.shape, dtype=sum_dtype(t.dtype, chunks > 1), device=t.device)


class Accumulators:
    """The gradients of one backward, summed over the chunks: the input's, the sliced projections' (each chunk
    adds into its rows, or columns for the output projection) and the module's other parameters'."""

    def __init__(
        self,
        parts: ChunkParts,
        x: torch.Tensor,
        needs: tuple[bool, ...],
        chunks: int,
        params: list[torch.Tensor],
    ) -> None:
        """``params``: the module's trainable parameters as the forward found them (PEFT's ``disable_adapter`` or
        ``set_adapter`` may change which are trainable before backward); ``parts``: the call's
        (:class:`~ulysses_sp.head_chunk_parts.ChunkParts`: its output projection is the one the forward used)."""
        self.parts, self.params = parts, params
        # (one that no longer requires grad gets none: backward's projections differentiate only what does)
        self.need = {id(p): need and p.requires_grad for p, need in zip(self.params, needs[1:], strict=True)}
        # The input's gradient sum: made only once the projections' output gradients waiting to be added into it
        # would outgrow it (kept till then: :meth:`_add_input`), so the first chunks' backward does not hold it.
        self.need_x, self._x = needs[0], None
        self.x_meta = (x.shape, sum_dtype(x.dtype, chunks > 1), x.device)
        self.x_bytes = math.prod(x.shape) * self.x_meta[1].itemsize
        self.waiting: deque[tuple[torch.Tensor, ChunkRun, str, int]] = deque()  # (grad [b n, out_c], run, name, stage)
        self.waiting_bytes = 0
        self.sums = {id(p): _zeros(p, chunks) for p in self.params if self.need[id(p)]}
        # the sums something was added to: the others' parameters get None, as autograd gives a parameter it does
        # not reach (e.g. an inactive LoRA adapter's), not zeros (which an optimizer would apply weight decay with)
        self.touched: set[int] = set()
        self.out_weight = self.sum(parts.out_proj.weight)
        self.sliced = parts.owner.sliced_parameters()

    def sum(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient sum to add to (None: not wanted), marked as reached."""
        found = self.sums.get(id(param))
        if found is not None:
            self.touched.add(id(param))
        return found

    @property
    def x(self) -> torch.Tensor | None:
        """The input's gradient sum, or None where the input needs none; made on first use (zeros, then what is
        waiting added in the order it came: the same sums as added at once)."""
        if self.need_x and self._x is None:
            shape, dtype, device = self.x_meta
            self._x = torch.zeros(shape, dtype=dtype, device=device)
            while self.waiting:  # each freed once added
                self._add_input(*self.waiting.popleft())
            self.waiting_bytes = 0
        return self._x

    def _add_input(self, grad_2d: torch.Tensor, run: ChunkRun, name: str, stage: int) -> None:
        """``x grad += grad_2d @ weight part`` for projection ``name``'s output gradient ``grad_2d [b n, out_c]``;
        while the sum is not made yet and the gradients waiting (their storages) stay smaller than it, kept for
        later instead: a chunk's q gradient is a fraction of the ``[t, h]`` sum."""
        if self._x is None:
            held = grad_2d.untyped_storage().nbytes()
            if self.waiting_bytes + held < self.x_bytes:
                self.waiting.append((grad_2d, run, name, stage))
                self.waiting_bytes += held
                return
        weight = cast(run.parts.part(name, stage, run.parts.linears[name].weight), grad_2d.dtype)  # [out_c, h]
        target = self.x.view(-1, self.x.shape[-1])
        add_mm(target, grad_2d, weight)  # (LoRA's share: InputLows.finish)

    def add_chunk(
        self,
        run: ChunkRun,
        stage: int,
        roots: Roots,
        grads: tuple[torch.Tensor | None, ...],
        leaves: dict[str, tuple],
        cut: ProjectionCut,
    ) -> None:
        """Backpropagate one stage's projections (``roots`` -> ``grads``) into the accumulators: autograd down to
        the cut projections' outputs (and to the leaves it still reaches), then their backward by hand."""
        inputs: list[torch.Tensor] = []
        # (the sliced projection whose part it is, or _INPUT, or None; the sum, None for the input's)
        targets: list[tuple[str | None, torch.Tensor | None]] = []
        if self.need_x and not cut.remade:  # what reaches the input besides the cut projections
            inputs.append(cut.x)
            targets.append((_INPUT, None))
        for name, pair in leaves.items():
            proj = run.parts.linears[name]
            for leaf, param in zip(pair[:2], (proj.weight, proj.bias), strict=True):  # (its adapters: by autograd)
                if isinstance(leaf, torch.Tensor) and self.need.get(id(param)):
                    inputs.append(leaf)
                    targets.append((name, param))
        for param in self.params:
            if id(param) not in self.sliced and self.need[id(param)]:
                inputs.append(param)
                targets.append((None, param))
        if cut.count:
            inputs.append(cut.anchor)
        if not inputs:
            return
        cut.sink = functools.partial(self._linear_backward, run, stage)
        with torch.enable_grad():
            found = roots.backward(grads, inputs)
        cut.sink = None
        for (name, param), grad in zip(targets, found, strict=False):  # the anchor's (None) is last
            if grad is None:
                continue
            if name == _INPUT:
                self.x.add_(grad)
            elif name is None:
                self.sum(param).add_(grad)
            else:
                run.parts.add(name, stage, self.sum(param), grad)

    def _linear_backward(self, run: ChunkRun, stage: int, name: str, cut: ProjectionCut, grad: torch.Tensor) -> None:
        """Projection ``name``'s backward for the stage, ``grad [b, n, out_c]`` of its output: added in place into
        the input's and its weight's and bias' sums, in the dtype the forward's matmul ran in (autocast's)."""
        proj = run.parts.linears[name]
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [b n, out_c]
        if self.need_x:
            self._add_input(grad_2d, run, name, stage)
        if self.need.get(id(proj.weight)):
            for start, length, x in cut.tiles():  # x [b, length, h]: the input, whole or one remade tile
                g = grad.narrow(-2, start, length).reshape(-1, grad.shape[-1])  # [b length, out_c]
                run.parts.add_mm(name, stage, self.sum(proj.weight), g.t(), cast(x.reshape(-1, x.shape[-1]), g.dtype))
        if proj.bias is not None and self.need.get(id(proj.bias)):
            run.parts.add(name, stage, self.sum(proj.bias), grad_2d.sum(0))
        for index, adapter in enumerate(run.parts.adapters(name, stage)):  # LoRA
            dtype = adapter.dtype(grad.dtype)
            g = cast(grad, dtype)  # [b, n, out_c]
            if self.need.get(id(adapter.b_param)):  # B_c += s g^T (dropout(x) A^T)
                low = cast(run.inputs.low(name, index, adapter), dtype)  # [b, n, r]
                b_grad = g.reshape(-1, g.shape[-1]).t().mm(low.reshape(-1, low.shape[-1])) * adapter.scaling
                run.parts.add(name, stage, self.sum(adapter.b_param), b_grad)
            if self.need.get(id(adapter.a)) or self.need_x:  # A's and the input's: once, from the sum of s g B_c
                run.inputs.add(name, index, adapter, g @ cast(adapter.b, dtype) * adapter.scaling)

    def finish_inputs(self, run: ChunkRun) -> None:
        """The LoRA adapters' gradients of A and of the block's input, once every stage has run
        (:meth:`~ulysses_sp.head_chunk_lora.InputLows.finish`)."""
        run.inputs.finish(lambda adapter: self.sum(adapter.a), lambda: self.x)

    def out_adapters(
        self, adapters: tuple[Adapter, ...], grad_out: torch.Tensor, lows: tuple[torch.Tensor, ...]
    ) -> list[tuple[Adapter, torch.Tensor]]:
        """The output projection's LoRA ``adapters``: B's gradient ``s g^T (dropout(y) A^T)`` from the forward's
        ``lows`` (``dropout(y) A^T [b, n, r]`` each) into the sums, and each adapter with ``s g B [b, n, r]``, from
        which every chunk takes its columns' part of A's gradient and of its input's
        (:mod:`ulysses_sp.head_chunk_output`)."""
        if len(adapters) != len(lows):
            raise RuntimeError("the output projection's LoRA adapters changed between forward and backward")
        found = []
        for adapter, low in zip(adapters, lows, strict=True):
            g = cast(grad_out, adapter.dtype(grad_out.dtype))  # [b, n, h]
            if self.need.get(id(adapter.b_param)):
                grad = g.reshape(-1, g.shape[-1]).t().mm(cast(low.reshape(-1, low.shape[-1]), g.dtype))
                self.sum(adapter.b_param).add_(grad * adapter.scaling)
            found.append((adapter, g @ cast(adapter.b, g.dtype) * adapter.scaling))
        return found

    def result(self, grad_out: torch.Tensor) -> tuple:
        """``(grad x, *grad params)`` in the parameters' order, each in its tensor's dtype."""
        bias = self.parts.out_proj.bias
        if bias is not None and self.need.get(id(bias)):
            self.sum(bias).add_(grad_out.reshape(-1, grad_out.shape[-1]).sum(0))
        grads = [cast(self.sums[id(p)], p.dtype) if id(p) in self.touched else None for p in self.params]
        return (self.x, *grads)
