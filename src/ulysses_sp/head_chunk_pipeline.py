"""The head-chunked attention block, chunk by chunk: forward, backward and the overlap of their exchanges.

:class:`ChunkRun` is one call of an attention module split into C chunks of heads (see
:mod:`ulysses_sp.head_chunks` for which modules and how many chunks). Each chunk is a generator that runs its
stages in order and yields right after it launches an exchange (:func:`ulysses_sp.comm.start_all_to_all`);
:func:`run_interleaved` keeps two chunks alive and alternates between them, so while chunk c's core computes,
chunk c+1's q/k/v exchange is in flight, and chunk c's output exchange runs while chunk c+1's core computes.
The order of the collectives depends only on C, so every rank issues the same exchanges in the same order.

Forward, per chunk (under no_grad): project q/k/v for the chunk's heads with the module's own code (its projections
sliced to those heads), exchange (one fused all-to-all), core, exchange back, and add the chunk's share of the
output projection into one ``[b, n, h]`` buffer. :class:`HeadChunkedFunction` saves the block's input (or, where a
tiled norm made it, that norm's input: :mod:`ulysses_sp.deferred_input`) and, where a block kernel runs the core
(:mod:`ulysses_sp.chunk_core`), the core's output after the exchange back (``[b, n, H, d_v]``) and its log-sum-exp.
Its backward runs each chunk by hand: the projections again (their graph), the q/k/v exchange, the output
projection's backward, one exchange of the saved output and its gradient to the attending ranks, the kernel's fused
backward, the q/k/v exchange's adjoint, the projections' backward (by hand for the projections of the block's input,
:class:`ProjectionCut`: in-place matmuls into the sums, no ``[t, h]`` temporaries). Under autocast q/k/v cross in
the autocast dtype, as autocast's sdpa would cast them. Collectives per layer: 2C forward, 3C backward. Where no
kernel fits (a ring, dropout, a window, softcap, the eager core) the chunk's core and output exchange are recomputed
instead and the core's backward is autograd's (4C backward). Only one or two chunks' q/k/v, exchange buffers and
core working set exist at any time.

On CUDA the exchanges run on the process group's own communication stream (``async_op=True``): the stream
waits for the producer's work, ``work.wait()`` makes the compute stream wait for the exchange without blocking
the host, and the process group keeps the buffers alive until then. On CPU gloo runs them in its own threads.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .attention import pad_qkv
from .chunk_core import chunk_kernel, kernel_backward, kernel_forward
from .comm import (
    out_local,
    out_local_grad,
    out_pair_send,
    out_send_buffer,
    out_send_grad,
    qkv_full,
    qkv_full_grad,
    qkv_send_buffer,
    qkv_send_grad,
    start_all_to_all,
)
from .cores import AttentionCall
from .deferred_input import Absent, NormRemake
from .head_chunk_grads import Accumulators, ProjectionCut, Roots, add_mm
from .head_split import DEPTH
from .tiling import Replay, compute_dtype

if TYPE_CHECKING:
    from .head_chunks import HeadChunkedAttention, HeadSplit

__all__ = ["ChunkRun", "HeadChunkedFunction", "placer", "run_interleaved"]

Stages = Generator[None, None, None]


def run_interleaved(chunks: Iterable[Stages], depth: int = DEPTH) -> None:
    """Run the chunk generators, ``depth`` of them alive at once, stepping them in turn (each step ends at the
    launch of an exchange). Deterministic: the same C gives the same order of collectives on every rank."""
    pending: Iterator[Stages] = iter(chunks)
    active: deque[Stages] = deque()

    def step(gen: Stages) -> None:
        try:
            next(gen)
        except StopIteration:
            return
        active.append(gen)

    try:
        while True:
            while len(active) < depth:
                gen = next(pending, None)
                if gen is None:
                    break
                step(gen)
            if not active:
                return
            step(active.popleft())
    finally:
        for gen in active:
            gen.close()


def placer(name: str, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], tuple[tuple, dict]]:
    """``place(t)`` for a :class:`ChunkRun`: the call's ``(args, kwargs)`` with ``t`` as the hidden states (keyword
    ``name`` or the first argument). It holds the other arguments only: the run keeps it until backward, and the
    hidden states it was called with (a ``[t, h]`` tensor per layer, through the whole step) must not be kept by it."""
    if name in kwargs:
        others = {k: v for k, v in kwargs.items() if k != name}
        return lambda t: (args, {**others, name: t})
    rest = args[1:]
    return lambda t: ((t, *rest), kwargs)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> Iterator[None]:
    """The RNG state a chunk's core started from in forward (attention dropout draws the same masks again)."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if state[1] is not None else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class ChunkRun:
    """One call of a head-chunked attention module: its arguments, its split into chunks and where it exchanges.

    ``place(x)`` gives the module's call arguments with ``x`` as its hidden states; ``prepare`` / ``attend``
    are :meth:`UlyssesAttention.prepare` / :meth:`UlyssesAttention.core_for` (the probe passes a local core),
    ``group`` the Ulysses group (None: no exchange); ``fused``: run the core through a block kernel where one fits
    (:func:`ulysses_sp.chunk_core.chunk_kernel`) and keep what its backward needs.
    """

    def __init__(
        self,
        owner: HeadChunkedAttention,
        place: Callable[[torch.Tensor], tuple[tuple, dict]],
        split: HeadSplit,
        *,
        prepare: Callable[..., AttentionCall],
        attend: Callable[..., torch.Tensor],
        group: dist.ProcessGroup | None,
        fused: bool = False,
    ) -> None:
        self.owner, self.place, self.split = owner, place, split
        self.prepare, self.attend, self.group = prepare, attend, group
        self.sp = 1 if group is None else dist.get_world_size(group)
        self.stats = owner.ctx.stats if group is not None else None
        self.wire = owner.ctx.comm_dtype
        self.rng: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * split.chunks
        # Chunks whose core runs through a block kernel (None: recomputed in backward), their lse and, for the
        # forward that saves them, the core outputs after the exchange back [b, n, H, d_v] (filled chunk by chunk).
        self.fused = fused
        self.kernels: list[Any | None] = [None] * split.chunks
        self.lse: list[torch.Tensor | None] = [None] * split.chunks
        self.local: torch.Tensor | None = None
        # Where a tiled norm made the block's input: how to remake it, and that norm's input while the forward saves
        # it instead of the block's input and while the backward remakes from it (:mod:`ulysses_sp.deferred_input`).
        self.remake: NormRemake | None = None
        self.source: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------- slices
    def part(self, name: str, chunk: int, t: torch.Tensor) -> torch.Tensor:
        """Chunk ``chunk``'s part of ``t``, a weight or bias (or its gradient) of projection ``name``: rows of the
        chunk's heads (query heads for the query and output projections, kv heads for the others); columns of
        the output projection's weight."""
        names, proj = self.owner.names, self.owner.projection(name)
        split = self.split
        if name == names.out:
            start, count = split.query_heads(chunk)
            per = proj.in_features // split.num_heads
            return t.narrow(t.dim() - 1, start * per, count * per) if t.dim() == 2 else t
        start, count = split.query_heads(chunk) if name in names.query else split.kv_heads(chunk)
        per = proj.out_features // (split.num_heads if name in names.query else split.num_kv_heads)
        return t.narrow(0, start * per, count * per)

    def weights(self, chunk: int, *, leaves: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The chunk's ``(weight, bias)`` of every sliced input projection: views, or (``leaves``) detached
        views that autograd differentiates separately."""
        found = {}
        for name in (*self.owner.names.query, *self.owner.names.kv):
            proj = self.owner.projection(name)
            pair = []
            for t in (proj.weight, proj.bias):
                if t is not None and leaves:
                    pair.append(self.part(name, chunk, t.detach()).requires_grad_(t.requires_grad))
                else:
                    pair.append(None if t is None else self.part(name, chunk, t))
            found[name] = (pair[0], pair[1])
        return found

    def project(
        self, x: torch.Tensor, chunk: int, weights: dict[str, tuple], cut: ProjectionCut | None = None
    ) -> tuple:
        """The chunk's padded local q ``[b, Hc, n, d]``, k/v ``[b, Hkv_c, n, d]`` and its :class:`AttentionCall`;
        ``cut``: record the projections of ``x`` there (:class:`ProjectionCut`)."""
        args, kwargs = self.place(x)
        heads = (self.split.query_heads(chunk)[1], self.split.kv_heads(chunk)[1])
        captured = self.owner.capture(args, kwargs, weights, heads, cut)
        call = self.prepare(self.owner.module, *captured.qkv, captured.mask, **captured.kwargs)
        return (*pad_qkv(*captured.qkv, call.width), call)

    def _exchange(self, send: torch.Tensor | list[torch.Tensor]) -> Generator[None, None, torch.Tensor]:
        """Launch the all-to-all of ``send``, yield while it is in flight, return what arrived (compute dtype).
        ``send`` may come in a one-element list, which is emptied: then no caller's name keeps it alive."""
        if isinstance(send, list):
            send = send.pop()
        if self.sp == 1:
            return send
        dtype = send.dtype
        recv, work = start_all_to_all(send.to(self.wire) if self.wire is not None else send, self.group, self.stats)
        del send
        yield
        if work is not None:
            start = time.perf_counter()
            work.wait()
            if self.stats is not None:
                self.stats.wait_s += time.perf_counter() - start
        return recv.to(dtype)

    # ------------------------------------------------------------------------------------------- forward
    def forward_chunk(self, x: torch.Tensor, chunk: int, out: torch.Tensor, save: bool = False) -> Stages:
        """Add chunk ``chunk``'s share of the output projection into ``out [b, n, h]`` (no_grad); ``save``: keep
        what the fused backward needs (the core's output after the exchange back and its lse)."""
        q, k, v, call = self.project(x, chunk, self.weights(chunk))
        heads, kv_heads = q.shape[1], k.shape[1]
        recv = yield from self._exchange(qkv_send_buffer(*_core_inputs(x, q, k, v), self.sp))
        del q, k, v
        full = qkv_full(recv)  # [b, h, N, d]
        del recv
        q_f, k_f, v_f = full.split(_split(heads, kv_heads, self.sp), dim=1)
        if call.dropout:
            self.rng[chunk] = _rng_state(x.device)
        kernel = self.kernel_for(call, q_f) if save else None
        if kernel is not None:
            core_out, self.lse[chunk] = kernel_forward(kernel, q_f, k_f, v_f, call)  # [b, N, Hc/P, d_v]
            self.kernels[chunk] = kernel
        else:
            core_out = self.attend(q_f, k_f, v_f, call)  # [b, N, Hc/P, d_v]
        del full, q_f, k_f, v_f
        recv = yield from self._exchange(out_send_buffer(core_out, self.sp))
        del core_out
        # [b, n, Hc, d_v]: with a kernel, this chunk's heads of the saved output, filled in place
        local = out_local(recv, self.saved_local(recv, chunk) if kernel is not None else None)
        del recv
        weight = self.part(self.owner.names.out, chunk, self.owner.out_proj().weight)  # [h, Hc d_v]
        out.view(-1, out.shape[-1]).addmm_(local.reshape(-1, weight.shape[1]), weight.t().to(out.dtype))

    def kernel_for(self, call: AttentionCall, q: torch.Tensor) -> Any | None:
        if not self.fused:
            return None
        return chunk_kernel(call, q, ring=self.owner.ctx.layout.ring, core_name=self.owner.ctx.core_name)

    def saved_local(self, recv: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk ``chunk``'s heads of the saved core output ``[b, n, H, d_v]`` (allocated on first use), for the
        received output ``recv [P, b, n, Hc/P, d_v]``."""
        if self.local is None:
            _, b, n, _, d_v = recv.shape
            self.local = recv.new_empty(b, n, self.split.num_heads, d_v)
        start, count = self.split.query_heads(chunk)
        return self.local.narrow(2, start, count)

    def forward(self, x: torch.Tensor, save: bool = False) -> torch.Tensor:
        """The block's output ``[b, n, h]``: every chunk's share, then the output projection's bias."""
        out_proj = self.owner.out_proj()
        out = x.new_zeros(*x.shape[:-1], out_proj.out_features, dtype=compute_dtype(x))
        run_interleaved(self.forward_chunk(x, c, out, save) for c in range(self.split.chunks))
        if out_proj.bias is not None:
            out += out_proj.bias
        return out

    # ------------------------------------------------------------------------------------------- backward
    def out_proj_backward(
        self, chunk: int, grad_out: torch.Tensor, local: torch.Tensor, acc: Accumulators
    ) -> torch.Tensor:
        """The output projection's backward for chunk ``chunk``: its weight columns' gradient into ``acc`` and the
        gradient of its input ``local [b, n, Hc, d_v]`` (returned)."""
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b n, h]
        out_name = self.owner.names.out
        weight = self.part(out_name, chunk, self.owner.out_proj().weight)  # [h, Hc d_v]
        if acc.out_weight is not None:
            add_mm(self.part(out_name, chunk, acc.out_weight), grad_2d.t(), local.reshape(-1, weight.shape[1]))
        return grad_2d.mm(weight.to(grad_2d.dtype)).view(local.shape)

    def _recompute_qkv(self, x: torch.Tensor, chunk: int) -> Generator[None, None, tuple]:
        """The chunk's projections again, with their graph (cut at the projections of ``x``), and their exchange:
        ``((leaves, cut), roots, call, full)`` with ``full [b, h, N, d]`` the core's q/k/v after the exchange and
        ``roots`` the projections' outputs as autograd sees them (:class:`Roots`; the tensors are freed once sent)."""
        leaves, cut = self.weights(chunk, leaves=True), ProjectionCut(x, self.remake, self.source)
        with torch.enable_grad():
            q, k, v, call = self.project(x, chunk, leaves, cut)
        roots = Roots(q, k, v)
        send = [qkv_send_buffer(*_core_inputs(x, q.detach(), k.detach(), v.detach()), self.sp)]
        del q, k, v
        recv = yield from self._exchange(send)
        return (leaves, cut), roots, call, qkv_full(recv)

    def _grads_back(
        self, chunk: int, grad_full: list[torch.Tensor], roots: Roots, graph: tuple, acc: Accumulators
    ) -> Stages:
        """The core's q/k/v gradient ``[b, h, N, d]`` (in a one-element list, emptied: only the exchange holds it)
        back to the chunk's projections, and their backward into ``acc`` (``graph``: the leaves and the cut)."""
        box = [qkv_full_grad(grad_full.pop(), self.sp)]
        recv = yield from self._exchange(box)
        grads = qkv_send_grad(recv, *roots.heads)
        grads = tuple(g.to(dtype) for g, dtype in zip(grads, roots.dtypes, strict=True))  # autocast's casts, undone
        del recv
        acc.add_chunk(self, chunk, roots, grads, *graph)

    def fused_backward_chunk(
        self, x: torch.Tensor, chunk: int, grad_out: torch.Tensor, acc: Accumulators, saved: tuple
    ) -> Stages:
        """Chunk ``chunk``'s gradients into ``acc`` from its saved core output and lse (``saved``), no recompute of
        the core: projections, q/k/v exchange, output projection, one exchange of the output and its gradient,
        the kernel's backward, the gradients' exchange, the projections' backward."""
        local_all, lse = saved
        graph, roots, call, full = yield from self._recompute_qkv(x, chunk)
        start, count = self.split.query_heads(chunk)
        local = local_all.narrow(2, start, count)  # [b, n, Hc, d_v]
        grad_local = self.out_proj_backward(chunk, grad_out, local, acc)  # [b, n, Hc, d_v]
        d_v = local.shape[-1]
        box = [out_pair_send(local, grad_local, self.sp)]  # [P, b, n, Hc/P, 2 d_v], held by the exchange alone
        del grad_local
        recv = yield from self._exchange(box)
        core_out, core_grad = out_send_grad(recv).split(d_v, dim=-1)  # [b, N, Hc/P, d_v] each
        del recv
        q_f, k_f, v_f = full.split(_split(*roots.heads, self.sp), dim=1)
        grads = kernel_backward(self.kernels[chunk], core_grad, q_f, k_f, v_f, core_out, lse, call)
        del core_out, core_grad, q_f, k_f, v_f, full
        grad_full = [torch.cat(grads, dim=1)]  # [b, h, N, d]
        del grads
        yield from self._grads_back(chunk, grad_full, roots, graph, acc)

    def backward_chunk(self, x: torch.Tensor, chunk: int, grad_out: torch.Tensor, acc: Accumulators) -> Stages:
        """Recompute chunk ``chunk`` (its core through autograd) and add its gradients into ``acc``."""
        graph, roots, call, full = yield from self._recompute_qkv(x, chunk)
        full.requires_grad_()  # [b, h, N, d]: the core's inputs as one leaf
        with torch.enable_grad(), _rng_restored(self.rng[chunk], x.device):
            core_out = self.attend(*full.split(_split(*roots.heads, self.sp), dim=1), call)
        recv = yield from self._exchange(out_send_buffer(core_out.detach(), self.sp))
        local = out_local(recv)  # [b, n, Hc, d_v]
        del recv
        grad_local = self.out_proj_backward(chunk, grad_out, local, acc)  # [b, n, Hc, d_v]
        del local
        recv = yield from self._exchange(out_local_grad(grad_local, self.sp))
        del grad_local
        grad_full = list(torch.autograd.grad(core_out, full, out_send_grad(recv)))  # the core's backward
        del recv, core_out, full
        yield from self._grads_back(chunk, grad_full, roots, graph, acc)

    def backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        needs: tuple[bool, ...],
        local: torch.Tensor | None,
        lse: tuple[torch.Tensor | None, ...],
        source: torch.Tensor | None = None,
    ) -> tuple:
        """Gradients of ``(x, *params)`` (None where not needed) for ``grad_out [b, n, h]``; ``local`` / ``lse``:
        what the forward saved (``lse[c]``: None where chunk c's core did not run through a kernel); ``source``:
        the input of the tiled norm that made ``x``, where ``x`` is an :class:`Absent` remade from it by tiles."""
        if source is None:
            x = x.detach().requires_grad_(needs[0])
        elif not isinstance(x, Absent) or self.remake is None:
            raise RuntimeError("a remade input needs an Absent input and the norm that made it")
        acc = Accumulators(self.owner, x, needs, self.split.chunks)
        grad_out = grad_out.contiguous()

        def chunk_stages(c: int) -> Stages:
            if lse[c] is not None:
                return self.fused_backward_chunk(x, c, grad_out, acc, (local, lse[c]))
            return self.backward_chunk(x, c, grad_out, acc)

        self.source = source
        try:
            run_interleaved(chunk_stages(c) for c in range(self.split.chunks))
        finally:
            self.source = None
        return acc.result(grad_out)


def _split(heads: int, kv_heads: int, sp: int) -> list[int]:
    """The q/k/v head counts on one rank after the exchange: H/P query heads, max(Hkv/P, 1) kv heads each."""
    hkv = max(kv_heads // sp, 1)
    return [heads // sp, hkv, hkv]


def _core_inputs(x: torch.Tensor, *qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k/v in the dtype the core computes in: under autocast its dtype (the model's RoPE may have made q and k
    fp32; autocast's sdpa casts them, and so does this before the exchange), else as they are."""
    dtype = compute_dtype(x)
    return tuple(t.to(dtype) for t in qkv)


class HeadChunkedFunction(torch.autograd.Function):
    """``out = attention block(x)`` in head chunks; saves ``x`` and, for the chunks whose core ran through a
    kernel, its output after the exchange back and its lse (through ``save_for_backward``, so activation
    checkpointing and offloading treat them as any saved tensor); backward works chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, run: ChunkRun, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.replay, ctx.x_meta = run, Replay(x.device), (x.shape, x.dtype, x.device)
        out = run.forward(x, save=True)
        # ``x``, or the input of the tiled norm that made it (run.source: backward remakes x from it by tiles)
        ctx.save_for_backward(x if run.source is None else run.source, run.local, *run.lse)
        run.local, run.lse, run.source = None, [None] * run.split.chunks, None  # held by ctx alone from here
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, local, *lse = ctx.saved_tensors
        x, source = (kept, None) if ctx.run.remake is None else (Absent(*ctx.x_meta), kept)
        with ctx.replay():
            needs = tuple(ctx.needs_input_grad[1:])
            grad_x, *grads = ctx.run.backward(x, grad_out, needs, local, tuple(lse), source)
        for hook in ctx.run.owner.ctx.backward_hooks:  # every chunk's backward is done (UlyssesAttention)
            hook()
        return (None, None if grad_x is None else grad_x.to(ctx.x_meta[1]), *grads)
