"""Which ``ulysses x ring`` layouts a model's head counts and the node size allow: arithmetic only, no process
group, so a launcher can check ``--sp`` / ``--ring`` before any rank starts. :class:`ulysses_sp.ParallelLayout`
builds the groups of the layout chosen here (and re-exports these names)."""

from __future__ import annotations

import math

__all__ = [
    "check_heads_split",
    "choose_layout",
    "choose_ring_degree",
    "describe_layouts",
    "divisors",
    "hybrid_layouts_for",
    "resolve_ring_degree",
    "ring_choices",
    "sp_degrees_for",
]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (found up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def sp_degrees_for(num_heads: int, num_kv_heads: int | None = None) -> list[int]:
    """The sp values that work for a model with these head counts (see :func:`check_heads_split`)."""
    kv = num_kv_heads or num_heads
    return [p for p in divisors(num_heads) if (kv % p == 0 or p % kv == 0)]


def check_heads_split(num_heads: int, num_kv_heads: int | None, sp: int) -> None:
    """Raise ValueError unless the heads split over ``sp`` ranks.

    Query heads must be divisible by sp. Key/value heads must be divisible by sp, or (GQA/MQA with
    fewer kv heads than ranks) sp must be divisible by the kv head count. Needs no process group, so a
    launcher can check a model against ``--sp`` before starting any rank.
    """
    kv = num_kv_heads or num_heads
    if num_heads % sp == 0 and (kv % sp == 0 or sp % kv == 0):
        return
    good = ", ".join(str(p) for p in sp_degrees_for(num_heads, kv))
    raise ValueError(
        f"the model has num_attention_heads={num_heads} and num_key_value_heads={kv}, which do not split "
        f"over sp={sp} ranks (query heads must be divisible by sp; kv heads divisible by sp, or sp "
        f"divisible by kv heads); sp values that work: {good}"
    )


def hybrid_layouts_for(sp: int, num_heads: int, num_kv_heads: int | None = None) -> list[tuple[int, int]]:
    """The ``(ulysses, ring)`` pairs with ``ulysses * ring == sp`` whose Ulysses degree the heads allow."""
    allowed = set(sp_degrees_for(num_heads, num_kv_heads))
    return [(u, sp // u) for u in sorted(divisors(sp), reverse=True) if u in allowed]


def describe_layouts(pairs: list[tuple[int, int]]) -> str:
    return ", ".join(f"ulysses {u} x ring {r}" for u, r in pairs)


def choose_layout(
    sp: int, num_heads: int | None, num_kv_heads: int | None = None, gpus_per_node: int | None = None
) -> tuple[int, int, str]:
    """``(ulysses, ring, reason)`` for ``sp`` ranks: the largest Ulysses degree that the heads allow and whose
    groups lie inside one node, the ring across nodes for the rest (``ulysses x ring == sp``).

    Ulysses runs two all-to-alls per layer among its ranks, so they belong on the fast links inside a node;
    the ring's k/v passes are point-to-point and overlap with compute, so they can cross nodes (dp sits on
    top, outermost). Ranks are laid out ``[dp, ring, ulysses]`` with Ulysses innermost, so a Ulysses group
    is ``ulysses`` consecutive ranks starting at a multiple of ``ulysses``: it lies inside one node exactly
    when ``ulysses`` divides ``gpus_per_node`` (torchrun numbers the ranks of a node consecutively).

    ``num_heads=None``: the heads set no limit (checked later by :func:`ulysses_sp.parallelize`).
    ``gpus_per_node=None``: the topology sets no limit. ``reason`` says in one sentence why, for a log line.
    Example: 32 heads / 8 kv heads at sp=16 on nodes of 8 GPUs -> ``(8, 2, "ulysses 8 x ring 2: ...")``.
    """
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ValueError(f"sp must be a positive int, got {sp!r}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be a positive int or None, got {gpus_per_node!r}")
    for name, heads_given in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if heads_given is not None and (not isinstance(heads_given, int) or heads_given < 1):
            raise ValueError(f"{name} must be a positive int or None, got {heads_given!r}")
    if num_heads is None:
        pairs = [(u, sp // u) for u in sorted(divisors(sp), reverse=True)]
        heads = "no head counts given"
    else:
        pairs = hybrid_layouts_for(sp, num_heads, num_kv_heads)
        heads = f"{num_heads} query / {num_kv_heads or num_heads} kv heads allow ulysses {pairs[0][0]}"
    fits = [(u, r) for u, r in pairs if gpus_per_node is None or gpus_per_node % u == 0]
    ulysses, ring = fits[0]
    if gpus_per_node is None:
        where = ""
    elif ulysses < pairs[0][0]:
        where = (
            f"; ulysses {pairs[0][0]} would not fit inside a node of {gpus_per_node} ranks, so the all-to-alls stay "
            f"inside each node (ulysses divides {gpus_per_node}) and the ring of {ring} crosses nodes"
        )
    else:
        where = f"; each Ulysses group lies inside a node of {gpus_per_node} ranks"
    if ring == 1:
        name = f"pure Ulysses (ulysses {sp})"
    elif ulysses == 1:
        name = f"pure ring (ring {sp})"
    else:
        name = f"ulysses {ulysses} x ring {ring}"
    return ulysses, ring, f"{name} for sp={sp}: {heads}{where}"


def choose_ring_degree(sp: int, num_heads: int, num_kv_heads: int | None = None) -> int:
    """The ring degree for ``sp`` ranks: 1 (pure Ulysses) when the heads split over ``sp``, else the
    smallest ring whose Ulysses degree ``sp / ring`` the heads allow (ring = sp, pure ring, always works).
    The topology-blind case of :func:`choose_layout`.

    Example: 2 query heads at sp=4 -> ring 2 (ulysses 2 x ring 2); 32 heads / 8 kv heads at sp=16 -> ring 2.
    """
    return choose_layout(sp, num_heads, num_kv_heads)[1]


def ring_choices(sp: int) -> str:
    return f"ring degrees that divide sp={sp}: {', '.join(str(r) for r in divisors(sp))}"


def resolve_ring_degree(
    sp: int,
    ring: int | None,
    num_heads: int | None,
    num_kv_heads: int | None = None,
    gpus_per_node: int | None = None,
) -> int:
    """The ring degree for :meth:`ParallelLayout.from_env` (see there), validated against the heads.

    Needs no process group, so a launcher can check ``--sp`` / ``--ring`` before any rank starts.
    """
    if ring is None:
        return choose_layout(sp, num_heads, num_kv_heads, gpus_per_node)[1]
    if not isinstance(ring, int) or ring < 1 or sp % ring:
        raise ValueError(f"ring must be a positive int dividing sp={sp}, got {ring!r}; {ring_choices(sp)}")
    if num_heads is not None:
        pairs = hybrid_layouts_for(sp, num_heads, num_kv_heads)
        if (sp // ring, ring) not in pairs:
            raise ValueError(
                f"ulysses {sp // ring} x ring {ring} cannot be formed for num_attention_heads={num_heads}, "
                f"num_key_value_heads={num_kv_heads or num_heads} (query heads must be divisible by the Ulysses "
                f"degree; kv heads divisible by it, or it by the kv heads); layouts of sp={sp} that work: "
                f"{describe_layouts(pairs)}"
            )
    return ring
