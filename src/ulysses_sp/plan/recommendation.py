"""The cheapest settings (sp, features) that train a target length on a number of GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..features import Features
from ..head_split import check_head_chunks, head_chunk_choices
from ..layout import check_heads_split, choose_layout, divisors
from .memory import MemoryPlan, plan_memory
from .search import max_seq_len
from .shape import ModelShape, model_shape
from .units import GiB

__all__ = ["Recommendation", "recommend"]


@dataclass
class Recommendation:
    """Settings for a target sequence length: the cheapest that reach it, or those that reach the longest."""

    sp: int
    dp: int
    features: Features
    plan: MemoryPlan
    max_seq_len: int
    reaches_target: bool
    target_seq_len: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "sp": self.sp,
            "ring": self.plan.ring,
            "dp": self.dp,
            "features": asdict(self.features),
            "max_seq_len": self.max_seq_len,
            "reaches_target": self.reaches_target,
            "target_seq_len": self.target_seq_len,
            "plan": self.plan.to_dict(),
        }


def _candidate_features(base: Features, stride: int | None) -> Iterator[Features]:
    # From cheapest to most expensive in step time: the tiled loss costs one extra lm_head matmul, the
    # tiled MLP a recomputed MLP, checkpointing a recomputed forward, offloading host transfers, and the
    # CPU optimizer a slow CPU AdamW step; last "auto": with host memory given, the planner's place and stride of
    # the checkpoints (1 in k layer inputs kept, the others recomputed: ulysses_sp.plan.placement).
    for checkpoint in ("none", "checkpoint", "offload", "auto"):
        for cpu_optimizer in (False, True):
            for tiled_mlp in (False, True):
                if cpu_optimizer and base.parallel != "fsdp2":
                    continue
                yield replace(
                    base,
                    tiled_loss=True,
                    tiled_mlp=tiled_mlp,
                    activation_checkpointing=checkpoint,
                    checkpoint_stride=stride if checkpoint == "auto" else base.checkpoint_stride,
                    cpu_offload_optimizer=cpu_optimizer,
                )


def recommend(
    model_config: Any,
    *,
    seq_len: int,
    world_size: int,
    gpu_memory_bytes: int = 80 * GiB,
    host_memory_bytes: int = 0,
    gpus_per_node: int | None = None,
    features: Features | None = None,
    micro_batch: int = 1,
) -> Recommendation:
    """The cheapest settings (sp, features) on ``world_size`` GPUs that train ``seq_len`` tokens.

    Candidates: every sp that divides the world (smallest first: least communication, most data parallelism;
    the ring inside it chosen as ``ulysses-sp train`` does), and the feature sets of increasing cost (see
    ``_candidate_features``). If none reaches ``seq_len``, the candidate with the longest trainable
    sequence is returned with ``reaches_target=False``.
    """
    shape = model_shape(model_config)
    stride = (features or Features()).checkpoint_stride  # None: the placement may choose one ("auto")
    base = (features or Features()).resolve("cuda")
    # past the heads: a ring inside sp; a requested number of head chunks must split each sp's Ulysses heads
    sps = [p for p in divisors(world_size) if _chunks_split(shape, p, base.head_chunks, gpus_per_node)]
    common = dict(
        gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        gpus_per_node=gpus_per_node,
        micro_batch=micro_batch,
    )
    best: tuple[int, int, Features, int | None] | None = None
    larger = {sp: _larger_rings(shape, sp, base.head_chunks, gpus_per_node) for sp in sps}
    for tier in _candidate_features(base, stride):
        for sp in sps:
            for candidate in _with_chunks(tier, shape, sp, None, gpus_per_node) if seq_len >= sp else ():
                plan = plan_memory(shape, seq_len=seq_len, sp=sp, dp=world_size // sp, features=candidate, **common)
                if plan.fits:
                    longest = max_seq_len(shape, sp=sp, dp=world_size // sp, features=candidate, **common)
                    return Recommendation(sp, world_size // sp, plan.features, plan, longest, True, seq_len)
    # none with train's layouts: larger rings (smaller Ulysses groups hold fewer heads' full-sequence buffers)
    for tier in _candidate_features(base, stride):
        for sp in sps:
            for ring in larger[sp] if seq_len >= sp else ():
                for candidate in _with_chunks(tier, shape, sp, ring, gpus_per_node):
                    settings = dict(sp=sp, dp=world_size // sp, ring=ring, features=candidate, **common)
                    plan = plan_memory(shape, seq_len=seq_len, **settings)
                    if plan.fits:
                        longest = max_seq_len(shape, **settings)
                        return Recommendation(sp, world_size // sp, plan.features, plan, longest, True, seq_len)
    for tier in _candidate_features(base, stride):
        for sp in sps:
            for ring in (None, *larger[sp]):
                for candidate in _with_chunks(tier, shape, sp, ring, gpus_per_node):
                    settings = dict(sp=sp, dp=world_size // sp, ring=ring, features=candidate, **common)
                    longest = max_seq_len(shape, **settings)
                    if best is None or longest > best[0]:
                        best = (longest, sp, candidate, ring)
    if best is None:
        raise ValueError(
            f"head_chunks={base.head_chunks} splits the heads of no sp that divides the {world_size} GPUs; use 0 / "
            "None to choose automatically"
        )
    longest, sp, candidate, ring = best
    settings = dict(sp=sp, dp=world_size // sp, ring=ring, features=candidate, **common)
    plan = plan_memory(shape, seq_len=max(longest, sp), **settings)
    return Recommendation(sp, world_size // sp, plan.features, plan, longest, False, seq_len)


def _with_chunks(
    candidate: Features, shape: ModelShape, sp: int, ring: int | None, gpus_per_node: int | None
) -> Iterator[Features]:
    """``candidate``, then, where its head chunks are automatic, each larger count that splits sp's Ulysses heads
    (``ring`` None: the ring ``ulysses-sp train`` chooses), fewest first: at lengths where automatic C keeps the
    exchange's q/k/v smallest (1 chunk, its core in slices) more chunks can hold less (a ring's or the whole
    attention's working set), for a chunk's fixed costs, which are cheaper than the next tier's."""
    yield candidate
    if candidate.head_chunks:
        return
    if ring is None:
        _, ring, _ = choose_layout(sp, shape.num_heads, shape.num_kv_heads, gpus_per_node)
    for chunks in head_chunk_choices(shape.num_heads, shape.num_kv_heads, sp // ring)[1:]:
        yield replace(candidate, head_chunks=chunks)


def _larger_rings(shape: ModelShape, sp: int, head_chunks: int | None, gpus_per_node: int | None) -> list[int]:
    """Ring degrees inside ``sp`` above the one ``ulysses-sp train`` chooses, smallest first, whose Ulysses degree
    splits the heads (and ``head_chunks``, when requested) and the GPUs of a node."""
    _, chosen, _ = choose_layout(sp, shape.num_heads, shape.num_kv_heads, gpus_per_node)
    rings = []
    for ring in divisors(sp):
        if ring <= chosen or (gpus_per_node and gpus_per_node % (sp // ring)):  # a Ulysses group inside a node
            continue
        try:
            check_heads_split(shape.num_heads, shape.num_kv_heads, sp // ring)
            if head_chunks:
                check_head_chunks(head_chunks, shape.num_heads, shape.num_kv_heads, sp // ring)
        except ValueError:
            continue
        rings.append(ring)
    return rings


def _chunks_split(shape: ModelShape, sp: int, head_chunks: int | None, gpus_per_node: int) -> bool:
    """Whether ``head_chunks`` (None / 0: automatic, always) splits the heads over sp's Ulysses ranks."""
    if not head_chunks:
        return True
    _, ring, _ = choose_layout(sp, shape.num_heads, shape.num_kv_heads, gpus_per_node)
    try:
        check_head_chunks(head_chunks, shape.num_heads, shape.num_kv_heads, sp // ring)
    except ValueError:
        return False
    return True
