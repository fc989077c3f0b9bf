"""The head-chunked attention block, chunk by chunk: forward, backward and the overlap of their exchanges.

:class:`ChunkRun` is one call of an attention module split into C chunks of heads (see
:mod:`ulysses_sp.head_chunks` for which modules and how many chunks). Each chunk is a generator that runs its
stages in order and yields right after it launches an exchange (:func:`ulysses_sp.comm.start_all_to_all`);
:func:`~ulysses_sp.interleave.run_interleaved` keeps two chunks alive and alternates between them, so while chunk
c's core computes, chunk c+1's q/k/v exchange is in flight, and chunk c's output exchange runs while chunk c+1's core
computes. The order of the collectives depends only on C, so every rank issues the same exchanges in the same order.

A chunk's heads are strided over the ranks (:class:`~ulysses_sp.head_split.ChunkHeads`): on each rank, chunk c
brings slice c of the heads it attends without chunks, so its query heads read the same kv heads in every chunk.
Where a chunk's kv heads are fewer than the ranks, the chunks share them: the layer's kv heads are projected with
chunk 0's queries and exchanged once, in chunk 0's exchange (forward and backward), each chunk exchanges its
query heads only and reads its rows of them, and backward sums the chunks' k/v gradients and sends the sum back once,
with the gradients of the first chunk to send after every chunk has added its own (:meth:`ChunkRun._grads_back`):
the bytes of C = 1's kv exchange, not C times a kv head sent whole to every rank, and no all-to-all of their own.

Forward, per chunk (under no_grad): project q/k/v for the chunk's heads with the module's own code (its projections
sliced to those heads), exchange (one fused all-to-all), core, exchange back, and add the chunk's share of the
output projection into one ``[b, n, h]`` buffer. :class:`~ulysses_sp.head_chunks.HeadChunkedFunction` saves the
block's input (or, where a tiled norm made it, that norm's input: :mod:`ulysses_sp.deferred_input`) and, where a
block kernel runs the core (:mod:`ulysses_sp.chunk_core`), the core's output after the exchange back (``[b, n, Hc,
d_v]`` per chunk) and its log-sum-exp. Its backward first reads the saved outputs, all it needs of them (the output
projection's weight gradient, and the output's row sums with its gradient, which the kernels read in place of the
output: :func:`~ulysses_sp.chunk_core.stand_in_output`), and drops them (:mod:`ulysses_sp.head_chunk_output`: freed
there under this library's checkpointing or offloading, which hand the saved tensors over); then runs each chunk by
hand: the projections again (their graph), one exchange of the q/k/v with the output's gradient and row sums
(:func:`~ulysses_sp.comm.pack_rows`), the kernel's fused backward (in blocks of queries and keys on long sequences:
:func:`~ulysses_sp.chunk_core.kernel_backward`), the q/k/v exchange's adjoint, the projections' backward (by hand
for the projections of the block's input, :class:`ProjectionCut`: in-place matmuls into the sums, no ``[t, h]``
temporaries; the input's gradient sum made only once the gradients waiting for it would outgrow it). Under autocast
q/k/v cross in the autocast dtype, as autocast's sdpa would cast them. Collectives per layer: 2C forward, 2C
backward (the shared kv heads travel with chunks' exchanges). Where no kernel fits (a ring, dropout, a window,
softcap, the eager core) the chunk's core and output exchange are recomputed instead and the core's backward is
autograd's (4C backward). Only one or two chunks' q/k/v (or q), exchange buffers and core working set exist at any
time, next to the shared kv heads (and, in backward, their gradients' sum: fp32 under a 16-bit dtype).

On CUDA the exchanges run on the process group's own communication stream (``async_op=True``): the stream
waits for the producer's work, ``work.wait()`` makes the compute stream wait for the exchange without blocking
the host, and the process group keeps the buffers alive until then. On CPU gloo runs them in its own threads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .attention import pad_qkv
from .chunk_core import chunk_kernel, kernel_backward, kernel_forward
from .comm import (
    Joined,
    out_local,
    out_local_grad,
    out_pack_send,
    out_send_buffer,
    out_send_grad,
    pack_rows,
    qkv_full,
    qkv_full_grad,
    qkv_send_grad,
    qkv_send_parts,
    start_all_to_all,
    unpack_rows,
)
from .cores import AttentionCall
from .deferred_input import Absent, NormRemake
from .grad_sums import cast, sum_dtype
from .head_chunk_grads import Accumulators, ProjectionCut, Roots
from .head_chunk_lora import InputLows
from .head_chunk_output import out_finish, out_input_grad, out_proj_backward, out_share, out_start, output_grads
from .head_chunk_parts import KV, ChunkParts, add_at, core_inputs, exchanged_heads, take
from .interleave import Stages, run_interleaved
from .replay import Replay

if TYPE_CHECKING:
    from .head_chunk_lora import Adapter
    from .head_chunks import HeadChunkedAttention
    from .head_split import ChunkHeads

__all__ = ["ChunkRun", "placer"]

Finish = Callable[[torch.Tensor, torch.dtype | None], Any]  # (what arrived, the dtype to cast it to) -> it, laid out


def placer(name: str, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], tuple[tuple, dict]]:
    """``place(t)`` for a :class:`ChunkRun`: the call's ``(args, kwargs)`` with ``t`` as the hidden states (keyword
    ``name`` or the first argument). It holds the other arguments only: the run keeps it until backward, and the
    hidden states it was called with (a ``[t, h]`` tensor per layer, through the whole step) must not be kept by it."""
    if name in kwargs:
        others = {k: v for k, v in kwargs.items() if k != name}
        return lambda t: (args, {**others, name: t})
    rest = args[1:]
    return lambda t: ((t, *rest), kwargs)


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
        split: ChunkHeads,
        *,
        prepare: Callable[..., AttentionCall],
        attend: Callable[..., torch.Tensor],
        group: dist.ProcessGroup | None,
        fused: bool = False,
    ) -> None:
        self.owner, self.place, self.split = owner, place, split
        self.prepare, self.attend, self.group = prepare, attend, group
        self.sp = 1 if group is None else dist.get_world_size(group)
        self.parts = ChunkParts(owner, split, owner.ctx.layout.rank)  # (the call's LoRA adapters, as they are now)
        self.blocks = split.ulysses // self.sp  # the ranks' blocks of a chunk's query heads this process attends
        # Where the chunks share the kv heads (split.shared_kv): the layer's k and v after the exchange [b, hkv, N, d]
        # each (views of one buffer, split once for all the chunks), kept while the chunks run, and in backward their
        # gradients' sum over the chunks [b, 2 hkv, N, d] (and its k and v halves, views) and what is needed to send
        # it back to the projections (chunk 0's capture's (leaves, cut) and the kv heads' roots).
        self.kv: tuple[torch.Tensor, ...] | None = None
        self.kv_grad: torch.Tensor | None = None
        self.kv_sums: tuple[torch.Tensor, ...] = ()
        self.kv_graph: tuple | None = None
        self.kv_done = 0  # chunks whose k/v gradients are in kv_grad
        self.stats = owner.ctx.stats if group is not None else None
        self.wire = owner.ctx.comm_dtype
        self.rng: list[Replay | None] = [None] * split.chunks  # where the core draws dropout masks
        # Chunks whose core runs through a block kernel (None: recomputed in backward), their lse and, for the
        # forward that saves them, their core outputs after the exchange back [b, n, Hc, d_v].
        self.fused = fused
        self.kernels: list[Any | None] = [None] * split.chunks
        self.lse: list[torch.Tensor | None] = [None] * split.chunks
        self.local: list[torch.Tensor | None] = [None] * split.chunks
        # Where a tiled norm made the block's input: how to remake it, and that norm's input while the forward saves
        # it instead of the block's input and while the backward remakes from it (:mod:`ulysses_sp.deferred_input`).
        self.remake: NormRemake | None = None
        self.source: torch.Tensor | None = None
        # LoRA adapters of the output projection (ulysses_sp.head_chunk_lora): dropout(y) A^T per adapter [b, n, r]
        # (forward; where it saves, then the block input's dropout(x) A^T, input_keys), and in backward each adapter
        # with the gradient of that, s g B [b, n, r]
        self.out_low: list[torch.Tensor] = []
        self.inputs: InputLows | None = None  # the LoRA adapters' work on the block's input, during one pass
        self.input_keys: list[tuple[str, int]] = []  # (projection, adapter index) of the input's lows forward saved
        self.params: list[torch.Tensor] = []  # the trainable parameters the forward differentiates (set by its caller)
        self.out_low_grads: list[tuple[Adapter, torch.Tensor]] = []

    # ------------------------------------------------------------------------------------------- stages
    def project(
        self, x: torch.Tensor, stage: int, weights: dict[str, tuple], cut: ProjectionCut | None = None
    ) -> tuple:
        """The stage's padded local q ``[b, Hc, n, d]``, k/v ``[b, Hkv_c, n, d]`` and its :class:`AttentionCall`
        (what a stage does not compute is zeros, :class:`~ulysses_sp.head_chunk_parts.Blank`); ``cut``: record the
        projections of ``x`` there (:class:`ProjectionCut`)."""
        args, kwargs = self.place(x)
        captured = self.owner.capture(args, kwargs, weights, self.parts.head_counts(stage), cut, self.inputs)
        call = self.prepare(self.owner.module, *captured.qkv, captured.mask, **captured.kwargs)
        return (*pad_qkv(*captured.qkv, call.width), call)

    def sent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """What a chunk exchanges as its own of its projected q/k/v (None for the rest): its q where the chunks share
        the kv heads (chunk 0's capture projects those too, :meth:`~ChunkParts.projects_shared_kv`), else all three."""
        return (q, None, None) if self.parts.shared_kv else (q, k, v)

    def core_qkv(self, chunk: int, full: torch.Tensor, heads: tuple[int, int]) -> tuple:
        """The chunk's core inputs from what its exchange brought (``full [b, h, N, d]``; ``heads``: the query and
        kv heads it sent): q, k, v ``[b, h_*, N, d]``; shared kv heads: the rows its query heads read (a view)."""
        if not self.parts.shared_kv:
            return tuple(full.split(exchanged_heads(*heads, self.sp), dim=1))
        if self.kv is None:
            raise RuntimeError("a chunk ran before the kv heads the chunks share arrived")
        rows = self.parts.shared_rows(chunk, self.blocks, full.device)
        k, v = self.kv
        return full, take(k, 1, rows), take(v, 1, rows)

    def kv_adder(self, chunk: int) -> Callable[[tuple, torch.Tensor, torch.Tensor], None]:
        """``add(piece, dk, dv)``: add a chunk's k/v gradients of the tokens ``piece`` (indices into ``[b, hkv_c,
        N]``, its heads all) into the shared kv heads' sums (the chunk's rows of them)."""
        rows = self.parts.shared_rows(chunk, self.blocks, self.kv_grad.device)

        def add(piece: tuple, dk: torch.Tensor, dv: torch.Tensor) -> None:
            for total, grad in zip(self.kv_sums, (dk, dv), strict=True):  # (views: added in place)
                add_at(total[piece[0], :, piece[2]], 1, rows, grad)

        return add

    def _exchange(self, parts: list[torch.Tensor | Joined], finish: list[Finish]) -> Generator[None, None, list]:
        """Launch one all-to-all of the send buffers ``parts`` (``[P, ...]``, any strides, or :class:`Joined`; in a
        list, emptied: then no caller's name keeps them alive; several are copied once into one buffer,
        :func:`~ulysses_sp.comm.pack_rows`), yield while it is in flight, return what arrived of each laid out by
        its ``finish`` (e.g. :func:`~ulysses_sp.comm.qkv_full`), which casts it back from the wire's dtype to the
        part's in the copy that lays it out (its dtype argument; None: it arrived in the part's)."""
        dtypes = [t.dtype for t in parts]
        if self.sp == 1:
            found = [t.tensor() if isinstance(t, Joined) else t for t in parts]
            parts.clear()
            return [done(t, None) for done, t in zip(finish, found, strict=True)]
        if len(parts) == 1 and (self.wire is None or not isinstance(parts[0], Joined)):  # (else a cast: pack_rows')
            send, layout = (parts[0].tensor() if isinstance(parts[0], Joined) else parts[0]), None
            send = send if self.wire is None else send.to(self.wire, memory_format=torch.contiguous_format)
        else:
            send, layout = pack_rows(parts, self.wire)
        parts.clear()
        recv, work = start_all_to_all(send, self.group, self.stats)
        del send
        yield
        if work is not None:
            start = time.perf_counter()
            work.wait()
            if self.stats is not None:
                self.stats.wait_s += time.perf_counter() - start
        found = [recv] if layout is None else unpack_rows(recv, layout)
        return [
            done(t, None if t.dtype == dtype else dtype) for done, t, dtype in zip(finish, found, dtypes, strict=True)
        ]

    # ------------------------------------------------------------------------------------------- forward
    def forward_chunk(self, x: torch.Tensor, chunk: int, out: torch.Tensor, save: bool = False) -> Stages:
        """Add chunk ``chunk``'s share of the output projection into ``out [b, n, h]`` (no_grad); ``save``: keep
        what the fused backward needs (the core's output after the exchange back and its lse)."""
        q, k, v, call = self.project(x, chunk, self.parts.weights(chunk))
        sent = self.sent(q, k, v)
        heads = (q.shape[1], 0 if sent[1] is None else k.shape[1])
        parts = [qkv_send_parts(*core_inputs(x, *sent), self.sp)]
        if self.parts.projects_shared_kv(chunk):  # the kv heads the chunks share travel with the first chunk's q
            parts.append(qkv_send_parts(*core_inputs(x, None, k, v), self.sp))
        del q, k, v, sent
        full, *kv = yield from self._exchange(parts, [qkv_full] * len(parts))  # [b, h, N, d]
        if kv:
            self.kv = kv.pop().chunk(2, dim=1)  # k, v [b, hkv, N, d]
        q_f, k_f, v_f = self.core_qkv(chunk, full, heads)
        if call.dropout:
            self.rng[chunk] = Replay(x.device)
        kernel = self.kernel_for(call, q_f) if save else None
        if kernel is not None:
            core_out, self.lse[chunk] = kernel_forward(kernel, q_f, k_f, v_f, call)  # [b, N, Hc/P, d_v]
            self.kernels[chunk] = kernel
        else:
            core_out = self.attend(q_f, k_f, v_f, call)  # [b, N, Hc/P, d_v]
        del full, q_f, k_f, v_f
        (local,) = yield from self._exchange([out_send_buffer(core_out, self.sp)], [out_local])  # [b, n, Hc, d_v]
        del core_out
        if kernel is not None:  # saved: one tensor per chunk, made as its output arrives (a view where sp = 1)
            self.local[chunk] = local = local.contiguous()  # (out_share reads it as [b n, Hc d_v]: a view then)
        out_share(self, chunk, local, out)

    def kernel_for(self, call: AttentionCall, q: torch.Tensor) -> Any | None:
        if not self.fused:
            return None
        return chunk_kernel(call, q, ring=self.owner.ctx.layout.ring, core_name=self.owner.ctx.core_name)

    def forward(self, x: torch.Tensor, save: bool = False) -> torch.Tensor:
        """The block's output ``[b, n, h]``: every chunk's share, then the output projection's bias (and LoRA)."""
        out = out_start(self, x)
        self.inputs = lows = InputLows(x, lambda: iter([(0, x.shape[-2], x)]))
        try:
            run_interleaved(self.forward_chunk(x, c, out, save) for c in range(self.split.chunks))
        finally:
            self.kv, self.inputs = None, None
        out = out_finish(self, out)
        if save:  # the block input's LoRA lows, saved after the output projection's: backward's, not remade
            self.input_keys, self.out_low = list(lows.lows), [*self.out_low, *lows.lows.values()]
        return out

    # ------------------------------------------------------------------------------------------- backward
    def _reproject(self, x: torch.Tensor, stage: int) -> tuple:
        """The stage's projections again, with their graph (cut at the projections of ``x``): ``((leaves, cut),
        roots, call, sends)`` with ``sends`` the q/k/v it sends ``[P, ...]`` (chunk 0's, then the shared kv heads,
        their graph kept for :meth:`_grads_back`) and ``roots`` those projections' outputs as autograd sees them
        (:class:`Roots`; the tensors are freed once the send buffers are made)."""
        cut = ProjectionCut(x, self.remake, self.source)
        with torch.enable_grad():  # LoRA adapters' rows of B: in the graph, which reaches B
            leaves = self.parts.weights(stage, leaves=True)
            q, k, v, call = self.project(x, stage, leaves, cut)
        sent = self.sent(q, k, v)
        # (the shared kv heads' backward comes later, through the same capture: the queries' keeps its graph)
        roots = Roots(*sent, retain=self.parts.projects_shared_kv(stage))
        sends = [qkv_send_parts(*core_inputs(x, *(None if t is None else t.detach() for t in sent)), self.sp)]
        if roots.retain:  # (the kv heads' leaves alone: chunk 0's gathered query rows are freed with its graph)
            self.kv_graph = (({name: leaves[name] for name in self.owner.names.kv}, cut), Roots(None, k, v))
            sends.append(qkv_send_parts(*core_inputs(x, None, k.detach(), v.detach()), self.sp))
        del q, k, v, sent
        return (leaves, cut), roots, call, sends

    def _recompute_qkv(self, x: torch.Tensor, stage: int) -> Generator[None, None, tuple]:
        """:meth:`_reproject` and the exchange (chunk 0's with the shared kv heads): ``(graph, roots, call, full)``,
        ``full [b, h, N, d]`` the q/k/v the stage sent, after the exchange."""
        graph, roots, call, parts = self._reproject(x, stage)
        full, *kv = yield from self._exchange(parts, [qkv_full] * len(parts))
        self._kv_arrived(kv)
        return graph, roots, call, full

    def _kv_arrived(self, kv: list[torch.Tensor]) -> None:
        """The shared kv heads after the exchange (``kv``: ``[b, 2 hkv, N, d]`` or none): kept in :attr:`kv` while
        the chunks run, with a zeroed sum for their gradients (fp32 under a 16-bit dtype)."""
        if not kv:
            return
        full = kv.pop()  # [b, 2 hkv, N, d]
        self.kv = full.chunk(2, dim=1)  # k, v [b, hkv, N, d]
        self.kv_grad = torch.zeros(full.shape, dtype=sum_dtype(full.dtype, True), device=full.device)
        self.kv_sums = self.kv_grad.chunk(2, dim=1)
        self.kv_done = 0

    def _drop_kv(self) -> None:
        """Let go of the shared kv heads, their gradients' sum (and its k and v halves) and their graph."""
        self.kv = self.kv_grad = self.kv_graph = None
        self.kv_sums = ()

    def _grads_back(
        self, stage: int, grad_full: list[torch.Tensor], roots: Roots, graph: tuple, acc: Accumulators
    ) -> Stages:
        """The gradient ``[b, h, N, d]`` of what the stage sent (in a one-element list, emptied: only the exchange
        holds it) back to its projections, and their backward into ``acc`` (``graph``: the leaves and the cut). The
        first chunk to send once every chunk has added its k/v gradients takes the shared kv heads' sum along."""
        parts = [qkv_full_grad(grad_full.pop(), self.sp)]
        stages = [(stage, roots, graph)]
        if self.kv_grad is not None and self.kv_done == self.split.chunks:
            parts.append(qkv_full_grad(cast(self.kv_grad, self.kv[0].dtype), self.sp))
            stages.append((KV, self.kv_graph[1], self.kv_graph[0]))
            self._drop_kv()
        finish = [lambda t, dtype, heads=sent.heads: qkv_send_grad(t, *heads, dtype) for _, sent, _ in stages]
        received = yield from self._exchange(parts, finish)
        for grads, (done, sent, leaves) in zip(received, stages, strict=True):
            # autocast's casts, undone
            grads = tuple([None if g is None else cast(g, dtype) for g, dtype in zip(grads, sent.dtypes, strict=True)])
            acc.add_chunk(self, done, sent, grads, *leaves)

    def _sent_grads(
        self, chunk: int, dq: torch.Tensor, dk: torch.Tensor | None, dv: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """The gradient of what the chunk sent, in a one-element list: its q/k/v's, or its q's where the chunks share
        the kv heads (their gradients go into :attr:`kv_grad`; None: already there)."""
        if not self.parts.shared_kv:
            return [torch.cat((dq, dk, dv), dim=1)]
        if dk is not None:
            self.kv_adder(chunk)((slice(None), slice(None), slice(None)), dk, dv)
        self.kv_done += 1
        return [dq]

    def fused_backward_chunk(
        self, x: torch.Tensor, chunk: int, grad_out: torch.Tensor, acc: Accumulators, saved: list, lse: torch.Tensor
    ) -> Stages:
        """Chunk ``chunk``'s gradients into ``acc`` from what ``output_grads`` (:mod:`ulysses_sp.head_chunk_output`)
        kept of its saved core output (``saved``, emptied) and its lse, no recompute of the core: projections, q/k/v
        exchange, one exchange of the output's gradient and row sums, the kernel's backward, the gradients' exchange,
        the projections' backward."""
        graph, roots, call, sends = self._reproject(x, chunk)
        grad_local, sums, shape = saved  # [b, n, Hc, d_v] (or None: made again), [b, n, Hc, 1]
        saved.clear()
        if grad_local is None:
            grad_local = out_input_grad(self, chunk, grad_out, shape)
        d_v = shape[-1]
        # The kernel's backward reads the output only through its row sums with the gradient: those travel with
        # the gradient instead of the output ([P, b, n, Hc/P, d_v + 1]), and the kernel gets an output with the same
        # sums (chunk_core.stand_in_output); in the same all-to-all as the q/k/v (held by the exchange alone)
        box = [sends[0], out_pack_send(self.sp, grad_local, sums), *sends[1:]]
        del sends, grad_local, sums
        full, arrived, *kv = yield from self._exchange(box, [qkv_full, out_send_grad, qkv_full][: len(box)])
        self._kv_arrived(kv)
        core_grad, row_sums = arrived.split((d_v, 1), dim=-1)  # [b, N, Hc/P, d_v], [b, N, Hc/P, 1]
        del arrived
        q_f, k_f, v_f = self.core_qkv(chunk, full, roots.heads)
        # in blocks of queries and keys where the sequence is long, the stand-in output made block by block; shared
        # kv heads: their gradients go into kv_grad block by block
        add_kv = self.kv_adder(chunk) if self.parts.shared_kv else None
        kernel = self.kernels[chunk]
        grads = kernel_backward(kernel, core_grad, q_f, k_f, v_f, None, lse, call, row_sums=row_sums, add_kv=add_kv)
        del core_grad, row_sums, q_f, k_f, v_f, full
        grad_full = self._sent_grads(chunk, *grads)  # [b, h, N, d]
        del grads
        yield from self._grads_back(chunk, grad_full, roots, graph, acc)

    def backward_chunk(self, x: torch.Tensor, chunk: int, grad_out: torch.Tensor, acc: Accumulators) -> Stages:
        """Recompute chunk ``chunk`` (its core through autograd) and add its gradients into ``acc``."""
        graph, roots, call, full = yield from self._recompute_qkv(x, chunk)
        full.requires_grad_()  # [b, h, N, d]: what the chunk sent, as one leaf
        replay = self.rng[chunk]
        with torch.enable_grad(), replay() if replay is not None else contextlib.nullcontext():
            core_in = self.core_qkv(chunk, full, roots.heads)
            if self.parts.shared_kv:  # the shared k/v rows as leaves of their own
                core_in = (full, *(t.detach().requires_grad_() for t in core_in[1:]))
            core_out = self.attend(*core_in, call)
        (local,) = yield from self._exchange([out_send_buffer(core_out.detach(), self.sp)], [out_local])
        grad_local = out_proj_backward(self, chunk, grad_out, local, acc)  # [b, n, Hc, d_v]
        del local
        (core_grad,) = yield from self._exchange([out_local_grad(grad_local, self.sp)], [out_send_grad])
        del grad_local
        leaves = core_in if self.parts.shared_kv else (full,)
        found = torch.autograd.grad(core_out, leaves, core_grad)  # the core's backward
        del core_grad, core_out, full, core_in, leaves
        grad_full = self._sent_grads(chunk, *found) if self.parts.shared_kv else list(found)
        del found
        yield from self._grads_back(chunk, grad_full, roots, graph, acc)

    def backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        needs: tuple[bool, ...],
        local: list[torch.Tensor | None],
        lse: tuple[torch.Tensor | None, ...],
        source: torch.Tensor | None = None,
        out_low: tuple[torch.Tensor, ...] = (),
    ) -> tuple:
        """Gradients of ``(x, *params)`` (None where not needed) for ``grad_out [b, n, h]``; ``local`` / ``lse``:
        what the forward saved per chunk (None where chunk c's core did not run through a kernel; ``local``, the
        cores' outputs, is emptied as they are read); ``source``: the input of the tiled norm that made ``x``, where
        ``x`` is an :class:`Absent` remade from it by tiles; ``out_low``: the forward's :attr:`out_low` (the output
        projection's LoRA lows, then those of the block's input, :attr:`input_keys`: not made again)."""
        if source is None:
            x = x.detach().requires_grad_(needs[0])
        elif not isinstance(x, Absent) or self.remake is None:
            raise RuntimeError("a remade input needs an Absent input and the norm that made it")
        acc = Accumulators(self.parts, x, needs, self.split.chunks, self.params)
        grad_out = grad_out.contiguous()
        adapters = self.parts.adapters(self.owner.names.out)
        self.out_low_grads = acc.out_adapters(adapters, grad_out, out_low[: len(adapters)])
        prepared = output_grads(self, grad_out, local, lse, acc)

        def chunk_stages(c: int) -> Stages:
            if prepared[c] is not None:
                return self.fused_backward_chunk(x, c, grad_out, acc, prepared[c], lse[c])
            return self.backward_chunk(x, c, grad_out, acc)

        self.source = source
        lows = dict(zip(self.input_keys, out_low[len(adapters) :], strict=True))
        self.inputs = InputLows(x, lambda: ProjectionCut(x, self.remake, source).tiles(), lows)
        try:
            run_interleaved(chunk_stages(c) for c in range(self.split.chunks))
            if self.kv_grad is not None:  # each chunk adds its k/v gradients before it sends, so the last one took them
                raise RuntimeError("the shared kv heads' gradients were not sent back")
            acc.finish_inputs(self)
        finally:
            self.source, self.out_low_grads, self.inputs = None, [], None
            self._drop_kv()
        return acc.result(grad_out)
