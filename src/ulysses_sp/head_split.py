"""How many head chunks an attention layer runs in, and which heads each chunk holds (no model code here).

:func:`head_chunk_choices` lists the chunk counts C that split the heads over the Ulysses ranks with the kv groups
intact, and :func:`chunk_exchange_bytes` what their q/k/v hold after the exchange (the budget test of
:func:`ulysses_sp.plan.attention.choose_head_chunks`, which picks C where the memory planner models the attention);
:class:`HeadSplit` maps a slice of one process's heads to its query and kv heads, and :class:`ChunkHeads` a chunk of
a layer's heads over the Ulysses ranks. The attention (:mod:`ulysses_sp.head_chunks`) and the memory planner both
call these, so the plan predicts the C that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layout import ParallelLayout

__all__ = [
    "DEFAULT_HEAD_CHUNK_BUDGET_BYTES",
    "DEPTH",
    "ChunkHeads",
    "HeadSplit",
    "check_head_chunks",
    "chunk_exchange_bytes",
    "core_slices",
    "head_chunk_choices",
]

DEFAULT_HEAD_CHUNK_BUDGET_BYTES = 1 << 30  # the q/k/v after the exchange of the chunks alive, per rank (automatic C)
DEPTH = 2  # chunks alive at once: one computing while the other's exchange is in flight


def head_chunk_choices(num_heads: int, num_kv_heads: int, ulysses: int) -> list[int]:
    """The chunk counts an attention layer of these heads can run in over ``ulysses`` ranks, ascending (1 first).

    C must divide the query heads into chunks of ``Hc = H / C`` heads that split over the ranks (``Hc % U == 0``),
    that hold whole kv groups or part of one (``Hc % g == 0`` or ``g % Hc == 0``, ``g = H / Hkv``), and whose
    kv heads split over the ranks as a whole layer's must (divisible by U, or dividing it).
    """
    group = num_heads // num_kv_heads
    found = []
    for chunks in range(1, num_heads + 1):
        heads = num_heads // chunks
        if num_heads % chunks or heads % ulysses or (heads % group and group % heads):
            continue
        kv = max(heads // group, 1)
        if kv % ulysses == 0 or ulysses % kv == 0:
            found.append(chunks)
    return found


def chunk_exchange_bytes(
    num_heads: int, num_kv_heads: int, ulysses: int, chunks: int, *, tokens: int, head_dim: int, element_size: int
) -> int:
    """Bytes of the q/k/v after the exchange on one rank while ``min(C, DEPTH)`` chunks are alive (``tokens`` =
    batch x the sequence a rank attends over, N, or N/R in a hybrid layout): each chunk's ``Hc/U`` query heads
    and, per chunk, its ``max(Hkv_c/U, 1)`` kv heads, or, where the chunks share them
    (:attr:`ChunkHeads.shared_kv`), the layer's ``max(Hkv/U, 1)`` kv heads once and, as backward holds them, their
    gradients' sum (fp32)."""
    c = element_size
    heads = ChunkHeads(num_heads, num_kv_heads, chunks, ulysses)
    alive = min(chunks, DEPTH)
    q = alive * heads.heads_per_chunk // ulysses * c
    if heads.shared_kv:
        kv = 2 * max(num_kv_heads // ulysses, 1) * (c + max(c, 4))
    else:
        kv = 2 * alive * max(heads.kv_per_chunk // ulysses, 1) * c
    return (q + kv) * tokens * head_dim


def core_slices(heads: int, kv_heads: int, *, tokens: int, head_dim: int, budget_bytes: int) -> int:
    """How many slices of its heads one rank's unchunked core runs in (:mod:`ulysses_sp.sliced_core`): the fewest
    that split ``heads`` query heads over ``kv_heads`` kv heads (whole kv groups or part of one, as
    :func:`head_chunk_choices` with one rank) whose fp32 ``[tokens, heads/S, head_dim]`` (the size of a fused
    kernel's dq accumulator) fits ``budget_bytes``; one query head per slice when none does. 1: not sliced."""
    choices = head_chunk_choices(heads, kv_heads, 1)
    fitting = [s for s in choices if 4 * tokens * (heads // s) * head_dim <= budget_bytes]
    return fitting[0] if fitting else choices[-1]


def layer_kv_chunks(requested: int | None, layout: ParallelLayout, num_heads: int, layer_kv: list[int]) -> int | None:
    """The head_chunks request for a model whose layers hold ``layer_kv`` kv heads (distinct, ascending; [] when the
    config does not vary them per layer, :func:`ulysses_sp.hf.layer_kv_heads`): each count must split over
    ``layout`` (ValueError), and layers of several counts run unchunked (a ValueError when C > 1 was asked for)."""
    for kv_heads in layer_kv:
        layout.check_heads(num_heads, kv_heads)
    return uneven_kv_chunks(requested, layer_kv)


def uneven_kv_chunks(requested: int | None, layer_kv: list[int] | tuple[int, ...]) -> int | None:
    """The head_chunks request where the layers hold ``layer_kv`` kv heads (as :func:`layer_kv_chunks`, without a
    layout to check them on): 1 where several counts run unchunked, ``requested`` otherwise; ValueError for C > 1
    there. The planner and ``ulysses-sp train``'s launcher ask it as parallelize does."""
    if len(layer_kv) < 2 or requested in (None, 0, 1):
        return 1 if len(layer_kv) > 1 else requested
    raise ValueError(
        f"head_chunks={requested!r}: the model's layers hold different numbers of kv heads {layer_kv} (a per-layer "
        "num_key_value_heads, e.g. Gemma-4's num_global_key_value_heads), which head chunks do not split; use "
        "head_chunks=1 (--head-chunks 1) or leave it automatic (0 / None: unchunked for this model)"
    )


def check_head_chunks(requested: object, num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    """ValueError naming ``requested`` and the chunk counts these heads allow over ``ulysses`` ranks."""
    if requested is None or requested == 0:
        return
    choices = head_chunk_choices(num_heads, num_kv_heads, ulysses)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested not in choices:
        raise ValueError(
            f"head_chunks={requested!r} does not split num_attention_heads={num_heads} (num_key_value_heads="
            f"{num_kv_heads}) over ulysses={ulysses} ranks: each chunk's heads must split over the ranks and hold "
            f"whole kv groups or part of one; use one of {choices}, or 0 / None to choose automatically"
        )


@dataclass(frozen=True)
class HeadSplit:
    """The heads of slice c of one process's heads: query heads ``[c Hc, (c+1) Hc)`` and the kv heads they read."""

    num_heads: int
    num_kv_heads: int
    chunks: int

    @property
    def heads_per_chunk(self) -> int:
        return self.num_heads // self.chunks

    def query_heads(self, chunk: int) -> tuple[int, int]:
        """``(first, count)`` of the chunk's query heads."""
        return chunk * self.heads_per_chunk, self.heads_per_chunk

    def kv_heads(self, chunk: int) -> tuple[int, int]:
        """``(first, count)`` of the kv heads the chunk's query heads read (one when it holds part of a group)."""
        group = self.num_heads // self.num_kv_heads
        first = chunk * self.heads_per_chunk // group
        return first, max(self.heads_per_chunk // group, 1)


@dataclass(frozen=True)
class ChunkHeads:
    """The heads of chunk c of an attention layer whose heads split over ``ulysses`` ranks (U).

    Where a chunk's kv heads would be fewer than the ranks (each would go whole to several ranks, once per chunk),
    the chunks share the kv heads (:attr:`shared_kv`) and are strided over the ranks: after the exchange rank r
    holds the query heads it holds without chunks (``[r H/U, (r+1) H/U)``) in C slices (:attr:`local`), chunk c
    bringing slice c, so its query heads read the same kv heads in every chunk; the layer's kv heads are exchanged
    once, as without chunks, and each chunk exchanges its query heads only (sent rank by rank, ``U`` blocks of
    ``Hc/U``). Otherwise chunk c is query heads ``[c Hc, (c+1) Hc)`` with the kv heads they read, its own.
    """

    num_heads: int
    num_kv_heads: int
    chunks: int
    ulysses: int = 1

    @property
    def heads_per_chunk(self) -> int:
        return self.num_heads // self.chunks

    @property
    def kv_per_chunk(self) -> int:
        """The kv heads one chunk's query heads read (one where they are part of one kv group)."""
        return max(self.heads_per_chunk * self.num_kv_heads // self.num_heads, 1)

    @property
    def shared_kv(self) -> bool:
        return self.chunks > 1 and self.kv_per_chunk < self.ulysses

    @property
    def local(self) -> HeadSplit:
        """One rank's query heads (``H/U``, reading ``max(Hkv/U, 1)`` kv heads) in C slices: chunk c's on it."""
        return HeadSplit(self.num_heads // self.ulysses, max(self.num_kv_heads // self.ulysses, 1), self.chunks)

    def query_ids(self, chunk: int) -> list[int]:
        """The chunk's query heads in the order they are sent (rank by rank)."""
        if not self.shared_kv:
            return list(range(chunk * self.heads_per_chunk, (chunk + 1) * self.heads_per_chunk))
        first, count = self.local.query_heads(chunk)
        per_rank = self.num_heads // self.ulysses
        return [r * per_rank + first + i for r in range(self.ulysses) for i in range(count)]

    def kv_ids(self, chunk: int) -> list[int]:
        """The kv heads the chunk sends, in order: all of them where the chunks share them, else those its query
        heads read."""
        if self.shared_kv:
            return list(range(self.num_kv_heads))
        first = chunk * self.heads_per_chunk * self.num_kv_heads // self.num_heads
        return list(range(first, first + self.kv_per_chunk))

    def shared_rows(self, chunk: int, blocks: int) -> list[int]:
        """Where the chunks share the kv heads: the rows of the received kv heads that the chunk's query heads read,
        one run per block of query heads. ``blocks``: the ranks' blocks this process holds (1; U where one process
        stands for all ranks, with all kv heads)."""
        first, count = self.local.kv_heads(chunk)
        return [r * self.num_kv_heads // self.ulysses + first + i for r in range(blocks) for i in range(count)]
