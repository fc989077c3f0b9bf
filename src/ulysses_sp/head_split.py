"""How many head chunks an attention layer runs in, and which heads each chunk holds (no model code here).

:func:`head_chunk_choices` lists the chunk counts C that split the heads over the Ulysses ranks with the kv groups
intact; :func:`choose_head_chunks` picks one (asked for, or the fewest whose q/k/v after the exchange fit a budget
per rank); :class:`HeadSplit` maps a chunk to its query and kv heads. The attention
(:mod:`ulysses_sp.head_chunks`) and the memory planner both call these, so the plan predicts the C that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_HEAD_CHUNK_BUDGET_BYTES",
    "DEPTH",
    "HeadSplit",
    "check_head_chunks",
    "choose_head_chunks",
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
    """Bytes of one chunk's q/k/v after the exchange on one rank: ``(Hc/U + 2 max(Hkv_c/U, 1)) x tokens x d``
    (``tokens`` = batch x the sequence a rank attends over, N, or N/R in a hybrid layout)."""
    split = HeadSplit(num_heads, num_kv_heads, chunks)
    rows = split.heads_per_chunk // ulysses + 2 * max(split.kv_heads(0)[1] // ulysses, 1)
    return rows * tokens * head_dim * element_size


def choose_head_chunks(
    num_heads: int,
    num_kv_heads: int,
    ulysses: int,
    *,
    tokens: int,
    head_dim: int,
    element_size: int,
    requested: int | None = None,
    budget_bytes: int = DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
) -> int:
    """The chunk count C: ``requested`` when > 0 (ValueError unless it is one of :func:`head_chunk_choices`),
    else the fewest chunks whose :func:`chunk_exchange_bytes` times the chunks alive at once (``min(C, DEPTH)``)
    fit ``budget_bytes`` (the smallest such working set when none does; C = 2 never beats C = 1 this way)."""
    choices = head_chunk_choices(num_heads, num_kv_heads, ulysses)
    if requested:
        check_head_chunks(requested, num_heads, num_kv_heads, ulysses)
        return requested
    sizes = {
        c: min(c, DEPTH)
        * chunk_exchange_bytes(
            num_heads, num_kv_heads, ulysses, c, tokens=tokens, head_dim=head_dim, element_size=element_size
        )
        for c in choices
    }
    fitting = [c for c in choices if sizes[c] <= budget_bytes]
    return fitting[0] if fitting else min(choices, key=lambda c: (sizes[c], c))


def core_slices(heads: int, kv_heads: int, *, tokens: int, head_dim: int, budget_bytes: int) -> int:
    """How many slices of its heads one rank's unchunked core runs in (:mod:`ulysses_sp.sliced_core`): the fewest
    that split ``heads`` query heads over ``kv_heads`` kv heads (whole kv groups or part of one, as
    :func:`head_chunk_choices` with one rank) whose fp32 ``[tokens, heads/S, head_dim]`` (the size of a fused
    kernel's dq accumulator) fits ``budget_bytes``; one query head per slice when none does. 1: not sliced."""
    choices = head_chunk_choices(heads, kv_heads, 1)
    fitting = [s for s in choices if 4 * tokens * (heads // s) * head_dim <= budget_bytes]
    return fitting[0] if fitting else choices[-1]


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
    """The heads of chunk c: query heads ``[c Hc, (c+1) Hc)`` and the kv heads they read."""

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
