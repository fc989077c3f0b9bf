"""The attention block's and the exchanges' terms of the memory model, bytes per local token, with head chunks.

:func:`attention_terms` gives what one attention layer holds at the moments :mod:`ulysses_sp.plan.memory` looks
at: what it saves from forward to backward, its forward (or recompute) working set, its backward working set
and the backward exchange's buffers. Unchunked (C = 1) they are the whole layer's heads at once. With the heads in
C chunks (:mod:`ulysses_sp.head_chunks`) the block saves its input (the input norm's output, counted with the
norm; with tiled norms the norm's input, which the layer holds anyway: :mod:`ulysses_sp.deferred_input`) and,
without a ring, the cores' output and lse (:mod:`ulysses_sp.chunk_core`), and each working set is that of DEPTH
chunks (:data:`ulysses_sp.head_split.DEPTH`: the chunk computing and the one whose exchange is in flight), each
the unchunked formula for one chunk's heads, or, without a ring, what was measured moment by moment (see
:func:`attention_terms`), plus the block's own ``[t, h]`` buffers (the output it sums into in forward; the
input's gradient in backward, made only once the gradients waiting for it would outgrow it).

C is :func:`choose_head_chunks`'s, the call the attention (:mod:`ulysses_sp.head_chunks`) makes at run time too, so the
plan predicts the C that runs; where no C's q/k/v fit its budget it picks the C of the lowest :func:`attention_peak`.

Notation as in :mod:`ulysses_sp.plan.memory`: U = ulysses, R = ring, d = head dim, c = bytes of the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..chunk_core import kernel_blocks
from ..head_split import (
    DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
    DEPTH,
    ChunkHeads,
    check_head_chunks,
    chunk_exchange_bytes,
    core_slices,
    head_chunk_choices,
)
from .shape import ModelShape

__all__ = [
    "AttentionTerms",
    "LatentTerms",
    "LayerMemory",
    "attention_backward",
    "attention_peak",
    "attention_terms",
    "choose_head_chunks",
    "latent_terms",
    "norm_terms",
    "planned_core_slices",
]


@dataclass(frozen=True)
class AttentionTerms:
    """Bytes per local token of one attention layer (see the module docstring)."""

    chunks: int
    saved: float  # saved by the attention from its forward to its backward
    saved_in_backward: float  # what of ``saved`` the chunks' backward holds where checkpointing hands it over
    backward_start: float  # head chunks: the moment before the chunks' backward, on top of everything saved
    o_proj_input: float  # saved by o_proj (0 in chunks: the block saves only its input)
    forward: float  # the forward's (recompute's) peak: projections, exchanges, core
    backward: float  # the backward's working set (the core's gradients and, in chunks, their recompute)
    exchange: float  # the backward exchange's buffers
    ring_backward: float  # the ring's backward instead of the core's (R > 1)
    local: float  # the projections' q/k/v before the exchange
    q_width: int  # query elements per local token after the exchange (H d)
    slices: int = 1  # the unchunked core's slices of heads (planned_core_slices)


@dataclass(frozen=True)
class LayerMemory:
    """The decoder layer around an attention as :func:`attention_peak` sees it: checkpointed or not (then every layer
    keeps what its attention saved until its backward), the model's decoder ``layers``, tiled norms or not, and the
    bytes of the layer's unsharded gradients held through its attention's backward (FSDP2's, in the compute dtype; 0
    under DDP). The planner makes it from its features, the attention at each call from its layer
    (:mod:`ulysses_sp.head_chunk_choice`)."""

    checkpointed: bool = True
    layers: int = 1
    tiled_norms: bool = True
    grad_bytes: int = 0


def norm_terms(c: int, hidden: int, tiled: bool) -> tuple[int, int, int]:
    """Bytes per local token the input norm saves, the post-attention norm saves, and the input norm's output where
    nothing saves it (alive through the (re)compute only). RMSNorm saves its fp32 input (an upcast copy under bf16),
    the normalised tensor cast back and its output (saved by the projections after it); the input norm's fp32 input
    IS the layer input (counted with it), the post-attention norm's is the residual sum. Tiled, a norm keeps only its
    input (the layer input; the residual sum): the projections of a tiled norm's output save the norm's input instead
    (:mod:`ulysses_sp.norm_projections`), and so does the head-chunked block, whose backward remakes the norm's output
    tile by tile (:mod:`ulysses_sp.deferred_input`; as the probe requires, its q/k/v projections are its only readers).
    """
    if tiled:
        return 0, c * hidden, c * hidden
    return ((4 if c < 4 else 0) + 2 * c) * hidden, (4 + 2 * c) * hidden, 0


def choose_head_chunks(
    num_heads: int,
    num_kv_heads: int,
    ulysses: int,
    *,
    tokens: int,
    head_dim: int,
    element_size: int,
    hidden: int,
    ring: int,
    device: str,
    requested: int | None = None,
    budget_bytes: int = DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
    layer: LayerMemory | Callable[[], LayerMemory] | None = None,
) -> int:
    """The chunk count C: ``requested`` when > 0 (ValueError unless it is one of
    :func:`~ulysses_sp.head_split.head_chunk_choices`), else the fewest chunks whose
    :func:`~ulysses_sp.head_split.chunk_exchange_bytes` (the chunks alive at once) fit ``budget_bytes``;
    when none does, the C whose attention peaks lowest as the memory planner models it
    (:func:`attention_peak`: the chunks' q/k/v, gradients, exchange buffers and core,
    a ring's included, over ``ring`` ranks of ``hidden``-wide tokens on ``device``, "cuda" or "cpu", in a decoder
    ``layer``: a :class:`LayerMemory`, a function called only here that reads it, or None for the defaults; the fewest
    chunks among equals), so that plan and run agree on C and C is the planner's lowest peak.

    Where none fits, the q/k/v alone (and then the q/k/v with their gradients) misled: C = 1 for 16 heads on 8 kv
    heads over 4 ranks at 2M tokens, where C = 4 plans 13% lower; C = 4 for Llama-3.1-8B in ulysses 2 x ring 4 at
    8M tokens (79.4 GiB), where C = 16 plans 72.7 GiB (``tests/unit/test_head_chunks.py``). A peak that assumed a
    checkpointed layer took C = 1 for 8 heads on 1 kv head in ulysses 4 x ring 2 at 8M tokens without checkpointing
    (16 layers: 214.7 GiB, where C = 2 plans 104.2: the unchunked ring block saves its q/k/v and output in every
    layer, the chunked one nothing but its input)."""
    choices = head_chunk_choices(num_heads, num_kv_heads, ulysses)
    if requested:
        check_head_chunks(requested, num_heads, num_kv_heads, ulysses)
        return requested
    kw = dict(tokens=tokens, head_dim=head_dim, element_size=element_size)
    fitting = [c for c in choices if chunk_exchange_bytes(num_heads, num_kv_heads, ulysses, c, **kw) <= budget_bytes]
    if fitting:
        return fitting[0]
    # (traced by dynamo in a compiled layer, once per graph: the cache it would ignore, with a warning, is left out)
    lowest = _lowest_peak_chunks.__wrapped__ if torch.compiler.is_compiling() else _lowest_peak_chunks
    layer = layer() if callable(layer) else layer or LayerMemory()
    return lowest(num_heads, num_kv_heads, ulysses, tokens, head_dim, element_size, hidden, ring, device, layer)


@functools.lru_cache(maxsize=256)
def _lowest_peak_chunks(
    num_heads: int,
    num_kv_heads: int,
    ulysses: int,
    tokens: int,
    head_dim: int,
    element_size: int,
    hidden: int,
    ring: int,
    device: str,
    layer: LayerMemory,
) -> int:
    """:func:`choose_head_chunks` where no C fits: the C of the lowest :func:`attention_peak` (the fewest chunks among
    equals). Cached: each layer's attention asks on every call, and the terms of every C took 56-82 us a call."""

    def peak(chunks: int) -> float:
        attn = attention_terms(
            num_heads, num_kv_heads, head_dim, hidden, ulysses=ulysses, ring=ring, c=element_size, device=device,
            chunks=chunks, tokens=tokens,
        )  # fmt: skip
        return attention_peak(attn, hidden=hidden, c=element_size, ring=ring, layer=layer, tokens=tokens // ulysses)

    best: tuple[float, int] | None = None
    for chunks in head_chunk_choices(num_heads, num_kv_heads, ulysses):  # ascending (dynamo's min takes no key)
        value = peak(chunks)
        if best is None or value < best[0]:
            best = (value, chunks)
    assert best is not None, "C = 1 is always a choice"
    return best[1]


def planned_core_slices(
    heads: int, kv_heads: int, ulysses: int, *, ring: int, chunks: int, tokens: int, head_dim: int
) -> int:
    """The slices of heads the unchunked sdpa core runs in at run time (:mod:`ulysses_sp.sliced_core`, the default
    budget); 1 with a ring or head chunks."""
    if ring > 1 or chunks > 1:
        return 1
    local_kv = max(kv_heads // ulysses, 1)
    return core_slices(
        heads // ulysses, local_kv, tokens=tokens, head_dim=head_dim, budget_bytes=DEFAULT_HEAD_CHUNK_BUDGET_BYTES
    )


def _cuda_kernel_buffers(
    heads: int, kv_rows: int, d: int, ulysses: int, c: int, slices: int, block_kernel: bool
) -> int:
    """Bytes per local token a CUDA attention kernel's backward holds besides q/k/v's and the output's gradients,
    for one of ``slices`` slices of the heads at a time (read from the kernels' source, not yet measured).

    torch's flash sdpa (FlashAttention-2's ``mha_bwd``): an fp32 dq accumulator and fp32 softmax row sums over the
    query heads it is given and, under GQA (fewer kv heads than query heads), the k/v gradients per query head
    before they are summed per kv head. A block kernel of :mod:`ulysses_sp.chunk_core` (``block_kernel``: a head
    chunk's core, or a slice of :mod:`ulysses_sp.sliced_core`) calls torch's aten op with the kv heads repeated
    for the query heads (the repeats and their gradients instead) and the output's gradient made contiguous; at
    one Ulysses rank (no exchange) q/k/v arrive in the model's layout and a slice of them is copied contiguous
    too. In slices the slice's own gradients exist next to the whole core's they are copied into.
    """
    part = heads * d // slices  # one slice's query heads (H/U/S over N = U t tokens), per local token
    kv_part = max(kv_rows // ulysses // slices, 1) * ulysses * d  # the kv heads one slice reads (k or v)
    gqa = part > kv_part
    found = 4 * part + 4 * heads // slices
    if not block_kernel:
        return found + 2 * c * part * gqa
    found += 4 * c * part * gqa + c * part + (c * part + 2 * c * kv_part if ulysses == 1 else 0)
    return found + (c * part + 2 * c * kv_part if slices > 1 else 0)


def _unchunked(
    heads: int,
    kv_heads: int,
    d: int,
    ulysses: int,
    ring: int,
    c: int,
    device: str,
    slices: int = 1,
    block_kernel: bool = False,
) -> AttentionTerms:
    # After the exchange a rank holds H/U query heads and hkv = max(Hkv/U, 1) kv heads over N/R tokens
    # (U = ulysses, R = ring), i.e. per local token H query and hkv x U kv head-rows.
    kv_rows = max(kv_heads // ulysses, 1) * ulysses
    qkv_width = (heads + 2 * kv_rows) * d
    # Attention over the FULL sequence for H/U heads (flash / cuDNN / CPU-flash sdpa: no N^2): sdpa saves
    # q/k/v after the exchange ([H/U + 2 hkv, N/R, d] = qkv_width per local token), its output and the fp32
    # log-sum-exp; o_proj saves the output made contiguous again.
    q_width, kv_width = heads * d, 2 * kv_rows * d  # per local token, after the exchange
    saved = c * qkv_width + c * q_width + 4 * heads
    # Backward of the core: the output's gradient and q/k/v's gradients; on CUDA also the kernel's own buffers.
    backward = c * q_width + c * qkv_width
    if device == "cuda":
        backward += _cuda_kernel_buffers(heads, kv_rows, d, ulysses, c, slices, block_kernel)
    # The exchanges (ulysses > 1), measured moment by moment: forward, q/k/v's receive buffer next to their
    # rearranged copy (the send buffer is freed first), then the output's send and receive buffers next to the
    # core's output; backward, the gradients' concatenation, its contiguous copy and the receive buffer.
    local_qkv = c * (heads + 2 * kv_heads) * d  # the projections' outputs, alive through the forward exchange
    exchange = ulysses > 1
    forward_exchange = max(2 * c * qkv_width, c * qkv_width + 3 * c * q_width) if exchange else c * q_width
    if ring > 1:  # the ring's forward: fp32 output and lse accumulators, the k/v block and the one arriving
        kernel = 4 if device == "cpu" else c
        forward_exchange = max(
            forward_exchange,
            (c * qkv_width if exchange else 0) + 4 * q_width + 4 * heads + 2 * c * kv_width + kernel * q_width,
        )
    return AttentionTerms(
        chunks=1,
        saved=saved,
        saved_in_backward=saved,
        backward_start=0,
        o_proj_input=c * q_width,
        forward=local_qkv + forward_exchange,
        backward=backward,
        exchange=3 * c * qkv_width if exchange else 0,  # the backward exchange's three buffers
        ring_backward=_ring_backward(q_width, kv_width, c, device, ring) if ring > 1 else 0,  # mid-ring
        local=local_qkv,
        q_width=q_width,
    )


def attention_terms(
    heads: int,
    kv_heads: int,
    d: int,
    hidden: int,
    *,
    ulysses: int,
    ring: int,
    c: int,
    device: str,
    chunks: int,
    tokens: int,
) -> AttentionTerms:
    """One attention layer's terms with its heads in ``chunks`` chunks over the ``tokens`` a rank attends (b x N /
    R; 1 chunk: the unchunked path, its core in :func:`planned_core_slices`' slices of heads)."""
    if chunks == 1:
        slices = planned_core_slices(heads, kv_heads, ulysses, ring=ring, chunks=1, tokens=tokens, head_dim=d)
        found = _unchunked(heads, kv_heads, d, ulysses, ring, c, device, slices, block_kernel=slices > 1)
        return dataclasses.replace(found, slices=slices)
    blocks = kernel_blocks(tokens)  # the chunks' kernel backward in blocks of queries and keys
    whole = _unchunked(heads, kv_heads, d, ulysses, ring, c, device)
    split = ChunkHeads(heads, kv_heads, chunks, ulysses)
    one = _unchunked(split.heads_per_chunk, split.kv_per_chunk, d, ulysses, ring, c, device, block_kernel=ring == 1)
    # Without a ring the chunks' cores run through a block kernel (ulysses_sp.chunk_core; the planner assumes the
    # sdpa core, no window, no softcap): the block saves their output after the exchange back ([t, H d]) and the
    # fp32 lse, filled chunk by chunk in forward, so that backward need not run the core again.
    saved = c * whole.q_width + 4 * heads if ring == 1 else 0
    # Backward holds the sums the chunks add into: the input's gradient (fp32 under a 16-bit dtype; made late, see
    # below) and the parameters'; and the DEPTH chunks alive, each a few of: its q/k/v after the exchange (qkv1), its
    # output's gradient exchanged with the output's row sums (q1 + sums1, send or receive buffer; the kernel then gets a
    # stand-in output, q1: chunk_core.stand_in_output), its q/k/v gradients (recomputed projections are freed once their
    # exchange has copied them: head_chunk_grads.Roots). Measured moment by moment (plan --simulate with a tracker of
    # live tensors; Llama h512, 8 x 64 heads / 2 kv and 16 x 128 / 4 kv, C = 2 and 4, sp 2, fp32, CPU): the larger of
    # the chunk in its core's backward (its q/k/v, stand-in output, gradients, one.backward: on CUDA with the kernel's
    # buffers) next to the next chunk's q/k/v and arriving gradient, and a moment of two chunks' q/k/v and 4 q1 (fitted
    # when the output itself travelled with its gradient, 2 q1 a buffer; sending the row sums instead lowered the 8 x 64
    # / 2 kv peaks by 0.25 (C=4) to 0.5 (C=2) [t, h], leaving the planner up to 3% over there, but not the 16 x 128 / 4
    # kv C=2 peak that this term matches: not re-fitted yet).
    own = (4 if c < 4 else c) * hidden
    q1 = c * one.q_width  # one chunk's core output (or its gradient) after the exchange, per local token
    kv1 = c * 2 * max(split.kv_per_chunk // ulysses, 1) * ulysses * d  # the k/v one chunk's core reads
    # Where the chunks share the kv heads (ChunkHeads.shared_kv) a chunk exchanges its q alone and reads its rows of
    # the layer's k/v, exchanged once and held while the chunks run (in backward next to their gradients' sum,
    # fp32 under a 16-bit dtype); its saved working set holds those rows as views, not copies.
    qkv1, shared, shared_sum, one_saved = c * split.heads_per_chunk * d + kv1, 0, 0, one.saved
    if split.shared_kv:
        shared = c * 2 * max(kv_heads // ulysses, 1) * ulysses * d
        shared_sum = (4 if c < 4 else c) * shared // c
        qkv1, one_saved = qkv1 - kv1, one.saved - kv1
    saved_in_backward, backward_start = saved, 0
    if ring == 1:
        # Forward (recompute), measured the same way: its peak is early, before `saved` is filled: the [t, h] output
        # the chunks add into, each alive chunk's projected q/k/v, the receive buffers of both exchanges in flight
        # and the send buffer of the latest.
        forward = c * hidden + DEPTH * one.local + (DEPTH + 1) * qkv1 + shared
        in_core = DEPTH * one_saved + _blocked(one, q1, kv1, c, device, blocks, split.shared_kv) + (DEPTH - 1) * q1
        exchanging = DEPTH * one_saved + 2 * DEPTH * q1
        # Backward first reads the saved outputs (o_proj's weight gradient, the row sums that travel with the
        # output's gradient: head_chunk_output.output_grads), keeping the first DEPTH chunks' output gradients (one more
        # being made), and drops them: where checkpointing or offloading hands the saved tensors over (this
        # library's, non-reentrant), only the lse and the row sums are held while the chunks run (without
        # checkpointing autograd holds the outputs until the block's backward returns: plan.memory). The input's
        # gradient sum is made only when the projections' output gradients waiting to be added (qkv1 a chunk)
        # would outgrow it (Accumulators._add_input): at most C - 1 chunks' of them, or the sum; at that moment
        # the sum, those waiting and the one that made it.
        saved_in_backward = 4 * heads + c * heads
        backward_start = (DEPTH + 1) * q1
        waiting = min(own, (chunks - 1) * qkv1)
        making_sum = own + waiting + qkv1 + shared + shared_sum
        backward = max(making_sum, waiting + shared + shared_sum + max(in_core, exchanging))
        # a chunk's q/k/v gradients sent and arriving
        exchange = own + shared + shared_sum + 2 * qkv1 + (DEPTH - 1) * (one_saved + q1)
    else:  # the ring's chunks recompute their core and output projection's input (not measured moment by moment)
        forward = saved + c * hidden + DEPTH * one.forward + shared  # + the [t, h] output the chunks add into
        backward = own + shared + shared_sum + DEPTH * (one_saved + one.backward + one.o_proj_input) + q1
        exchange = own + shared + shared_sum + DEPTH * one.exchange
    return AttentionTerms(
        chunks=chunks,
        saved=saved,
        saved_in_backward=saved_in_backward,
        backward_start=backward_start,
        o_proj_input=0,
        forward=forward,
        backward=backward,
        exchange=exchange,
        ring_backward=DEPTH * one.ring_backward,
        local=one.local,
        q_width=whole.q_width,
    )


def _blocked(one: AttentionTerms, q1: int, kv1: int, c: int, device: str, blocks: int, shared: bool) -> float:
    """A chunk's kernel backward (:func:`ulysses_sp.chunk_core.kernel_backward`), bytes per local token: ``one``'s
    (its stand-in output and q/k/v gradients) in one call; in ``blocks`` blocks the fp32 sums of dq (and of dk/dv
    where the chunk sent its own kv heads: shared ones go into their sum, counted with it), one call's stand-in
    output and gradients (1 / blocks of the chunk's; the CPU kernel's in fp32) and dq cast back where it is not fp32."""
    if blocks == 1:
        return one.backward
    kernel = 4 if device == "cpu" else c
    q_el, kv_el = q1 // c, kv1 // c  # elements per local token
    sums = 4 * q_el + (0 if shared else 4 * kv_el)
    cuda_buffers = one.backward - c * (2 * q_el + kv_el)  # one.backward less its stand-in output and gradients
    call = (c * q_el + kernel * (q_el + kv_el) + cuda_buffers) / blocks
    return sums + call + (c * q_el if c != 4 else 0)


def _ring_backward(q_width: int, kv_width: int, c: int, device: str, ring: int) -> int:
    """Bytes per local token the ring's backward holds besides the attention's saved tensors (:mod:`ulysses_sp.ring`):
    the output's gradient and the fp32 dq accumulator; at the first step (the diagonal block) this step's fp32
    k/v-gradient share, the k/v block and the one arriving, and the kernel's gradients of the whole block; at a
    later step three fp32 k/v-gradient blocks (this step's share, the one travelling, the one arriving), one k/v
    block (two before the last step) and the gradients of a half-visible block. Where the kernel computes in
    fp32 but the step runs in bf16 (the CPU kernel), its fp32 copies of q, the output, its gradient and the k/v
    block too."""
    kernel = 4 if device == "cpu" else c
    casts = kernel * (3 * q_width + kv_width) if kernel != c else 0
    first = 4 * kv_width + 2 * c * kv_width + kernel * (q_width + kv_width)
    half_block = kernel * max(q_width + kv_width // 2, q_width // 2 + kv_width)
    later = 3 * 4 * kv_width + (2 if ring > 2 else 1) * c * kv_width + half_block
    return c * q_width + 4 * q_width + casts + max(first, later)


def attention_backward(attn: AttentionTerms, mode: str, ring: int) -> float:
    """Bytes per local token the last layer's attention holds in its backward: what it saved (all of it without
    checkpointing, where autograd holds it until the block's backward returns; else what the chunks keep after
    reading it) and its working set (the ring's is counted apart), or the moment before its chunks if larger."""
    held = attn.saved if mode == "none" else attn.saved_in_backward
    return max(attn.saved + attn.backward_start, held + (0 if ring > 1 else attn.backward))


def attention_peak(attn: AttentionTerms, *, hidden: int, c: int, ring: int, layer: LayerMemory, tokens: int) -> float:
    """Bytes per local token (of ``tokens`` on this rank) at the highest of the moments :mod:`ulysses_sp.plan.memory`
    looks at in one attention layer of terms ``attn`` (:func:`attention_terms`) in a decoder ``layer``: the MLP's
    backward beside what the attention saved, o_proj's input, the post-attention norm's and 2 ``[t, h]`` gradients (a
    lower bound: the MLP's own working set is left out); the attention's (re)compute beside the input norm's output
    where nothing saves it and, checkpointed, the stream's gradient waiting for it; its backward (a ring's included)
    and its backward exchange beside the stream's gradient and the layer's gradients; without checkpointing, under
    all of them, the other ``layers - 1`` layers' attention saved tensors. What does not change with C (weights,
    checkpoints, the input norm's saved tensors, the other layers' but their attention's) is left out, so the C of
    the lowest is the C of the lowest planned peak where these moments are the peak. Where no C fits its budget,
    :func:`choose_head_chunks` compares the C by it."""
    stream, grads = c * hidden, layer.grad_bytes / tokens
    _, norm_post, remade = norm_terms(c, hidden, layer.tiled_norms)
    held = attn.saved + attn.o_proj_input  # what the attention block saves (o_proj's input included)
    backward = attention_backward(attn, "checkpoint" if layer.checkpointed else "none", ring) + attn.ring_backward
    waiting = stream if layer.checkpointed else 0
    moments = (held + norm_post + 2 * stream, attn.forward + remade + waiting, backward + stream + grads)
    others = 0 if layer.checkpointed else (layer.layers - 1) * held
    return others + max(*moments, attn.exchange + stream + grads)


@dataclass(frozen=True)
class LatentTerms:
    """Bytes per local token multi-head latent attention (DeepSeek-V2/V3) adds to a layer's attention terms."""

    saved: float = 0  # its low-rank projections' activations, saved from its forward to its backward
    forward: float = 0  # the forward's own tensors, alive while its q/k/v are exchanged (the recompute's peak)
    o_proj_padding: float = 0  # o_proj reads the output v heads wide, not as wide as the padded q/k/v heads


def latent_terms(shape: ModelShape, c: int, *, exchange: bool) -> LatentTerms:
    """MLA's terms (none for other attention). Saved: each low-rank projection's output (q: ``q_lora_rank``, kv:
    ``kv_lora_rank`` + the rotary part) goes through an RMSNorm that keeps its fp32 input (under fp32 the output
    itself, whose rotary part the kv norm's view holds too), the normalised copy and its output. Alive through the
    forward's exchange (measured, ``plan --simulate``, DeepSeek-V2/V3 shapes, sp 1 and 2): the forward's locals, the
    q projection's output (H (d_nope + d_rope)), the kv up-projection's (H (d_nope + d_v)), the rotary parts made
    for q and k and, under bf16, the low-rank projections' outputs, next to the q/k/v the plain formulas count;
    without an exchange (``exchange`` False) they are alive at o_proj too, with its input and output."""
    if not shape.rope_dim:
        return LatentTerms()
    heads, rope, v_width = shape.num_heads, shape.rope_dim, shape.v_head_dim or shape.head_dim
    saved = (4 + 2 * c) * (shape.q_rank + shape.kv_rank) + (c * rope if c == 4 and shape.kv_rank else 0)
    nope = max(shape.head_dim - rope, 0)
    forward = c * (heads * (nope + rope) + heads * (nope + v_width) + heads * rope + rope)
    if c < 4:  # the low-rank projections' outputs (under fp32 the norms' saved inputs)
        forward += c * (shape.q_rank + shape.kv_rank + rope)
    if not exchange:  # at one Ulysses rank the forward peaks at o_proj: the output cut to v's width, copied, its output
        forward += c * heads * v_width + c * shape.hidden_size
    return LatentTerms(saved, forward, c * heads * (shape.head_dim - v_width))
