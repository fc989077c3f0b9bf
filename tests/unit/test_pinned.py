"""ulysses_sp.pinned: host buffers handed out, given back and handed out again (the page-locking itself needs CUDA:
tests/gpu/test_gpu_offload.py)."""

import torch

from ulysses_sp.pinned import PinnedBuffers, buffer_bytes

MiB = 1 << 20


def _buffers() -> tuple[PinnedBuffers, list[int]]:
    locked: list[int] = []

    def lock(buffer: torch.Tensor) -> torch.Tensor:  # what page_lock would register: the buffer's bytes
        locked.append(buffer.untyped_storage().nbytes())
        return buffer

    return PinnedBuffers(lock), locked


def test_a_buffer_holds_the_request_and_is_handed_out_again_once_given_back():
    pool, locked = _buffers()
    first, second = pool.take(20 * MiB), pool.take(20 * MiB)
    assert first.dtype == torch.uint8 and first.numel() == 20 * MiB and locked == [20 * MiB, 20 * MiB]
    assert first.data_ptr() != second.data_ptr()
    pool.give(first)
    assert pool.free_bytes() == 20 * MiB
    again = pool.take(20 * MiB)
    assert again.data_ptr() == first.data_ptr() and pool.made == 2 and len(locked) == 2
    assert pool.free_bytes() == 0


def test_a_free_buffer_serves_a_slightly_smaller_request_and_not_a_much_smaller_or_larger_one():
    pool, locked = _buffers()
    big = pool.take(20 * MiB)
    pool.give(big)
    assert pool.take(19 * MiB).data_ptr() == big.data_ptr()  # 1/19 to spare: within an eighth
    pool.give(big)
    small = pool.take(10 * MiB)  # half: a new buffer, and the unsuitable free one is let go
    assert small.data_ptr() != big.data_ptr() and pool.free_bytes() == 0 and locked == [20 * MiB, 10 * MiB]
    pool.give(small)
    larger = pool.take(10 * MiB + 1)  # more than it holds
    assert larger.numel() == buffer_bytes(10 * MiB + 1) > 10 * MiB and pool.made == 3 and pool.free_bytes() == 0


def test_the_smallest_suitable_buffer_is_handed_out():
    pool, _ = _buffers()
    a, b = pool.take(21 * MiB), pool.take(20 * MiB)
    pool.give(a)
    pool.give(b)
    assert pool.take(20 * MiB).data_ptr() == b.data_ptr()
    assert pool.take(20 * MiB).data_ptr() == a.data_ptr() and pool.made == 2
