"""Host memory of one rank: what FSDP2's CPU offload and the offloaded checkpoints hold, as the allocators hold it.

Pinned (page-locked) host memory from PyTorch's CachingHostAllocator is rounded up to the next power of two per
request, and freed blocks are kept for the next request of that size (``ATen/core/CachingHostAllocator.h``,
``allocate``): FSDP2's sharded fp32 parameters and the fp32 gradients it copies to the host. The offloaded layer
inputs are pinned at about their size instead (:mod:`ulysses_sp.pinned`: at most 1/32 more; reused from step to
step). Pageable (exact bytes): AdamW's states and its CPU step's temporaries. docs/memory.md ("Host memory") gives
the sources.
"""

from __future__ import annotations

from ..pinned import buffer_bytes
from .shape import ModelShape

__all__ = ["host_terms", "pinned_bytes"]


def pinned_bytes(nbytes: int) -> int:
    """Host bytes one pinned allocation of ``nbytes`` takes: the next power of two (0 for nothing)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def host_terms(
    shape: ModelShape, *, world: int, offload_states: bool, checkpoint_bytes: int, checkpoints: int
) -> dict[str, int]:
    """Host bytes of one rank by component at its host peak, the optimizer step (the checkpoints' buffers freed in
    backward are kept for the next step, so the step adds to all of them).

    Args:
        world: the ranks FSDP2 shards over (dp x sp); a rank's shard of a tensor is ``ceil(rows / world)`` rows,
            padded to that on every rank (the largest, rank 0's, for the gradient and the states).
        offload_states: FSDP2's ``CPUOffloadPolicy()`` (pinned parameters and gradients, AdamW on the CPU).
        checkpoint_bytes: bytes of one offloaded layer input ``[b, n / sp, h]`` (one pinned buffer of
            :func:`ulysses_sp.pinned.buffer_bytes`); ``checkpoints`` how many are kept (0: none offloaded).
    """
    terms = dict.fromkeys(("parameters", "gradients", "optimizer"), 0)
    terms["checkpoints"] = checkpoints * buffer_bytes(checkpoint_bytes)  # ulysses_sp.pinned's buffers
    if offload_states:
        shards = [(4 * -(-rows // world) * row, count) for rows, row, count in shape.param_tensors]  # fp32
        terms["parameters"] = terms["gradients"] = sum(count * pinned_bytes(size) for size, count in shards)
        # exp_avg and exp_avg_sq (zeros_like: not pinned); the for-loop step's denominator makes two temporaries
        # of a parameter's size (sqrt, quotient) while the previous parameter's is still held: 3 of the largest.
        terms["optimizer"] = sum(2 * size * count for size, count in shards) + 3 * max(size for size, _ in shards)
    return terms
