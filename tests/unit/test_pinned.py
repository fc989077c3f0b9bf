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


def _step(pool: PinnedBuffers, sizes: list[int]) -> list[torch.Tensor]:
    """One step: take a buffer for each size (a forward), then give them all back (its backward)."""
    taken = [pool.take(size) for size in sizes]
    for buffer in reversed(taken):
        pool.give(buffer)
    return taken


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


def test_steps_of_the_same_sizes_reuse_every_buffer_small_ones_included():
    """A 3 KiB request gets a 4 KiB page, more than an eighth to spare: it must still be handed out again."""
    pool, locked = _buffers()
    sizes = [10 * MiB, 3072, 10 * MiB, 3072, 5000]
    for _ in range(3):
        _step(pool, sizes)
    assert pool.made == len(sizes) and locked == [buffer_bytes(size) for size in sizes]


def test_a_free_buffer_serves_a_request_it_holds_with_an_eighth_to_spare_at_most():
    pool, _ = _buffers()
    (big,) = _step(pool, [20 * MiB])
    (again,) = _step(pool, [19 * MiB])
    assert again.data_ptr() == big.data_ptr() and pool.made == 1
    (small,) = _step(pool, [10 * MiB])  # half: a new buffer
    assert small.data_ptr() != big.data_ptr() and pool.made == 2


def test_a_new_length_lets_go_the_buffers_no_request_of_this_step_took_and_only_those():
    pool, _ = _buffers()
    _step(pool, [20 * MiB, 20 * MiB])
    kept = pool.take(20 * MiB)  # the next step takes one of the old size and gives it back at once
    held = pool.take(8 * MiB)  # a new size: the other old buffer (untouched this step) goes
    pool.give(kept)
    assert pool.free_bytes() == 20 * MiB  # the one this step took stays
    other = pool.take(6 * MiB)  # another miss: `kept` was taken this step, so it stays
    assert pool.free_bytes() == 20 * MiB and pool.made == 4
    for buffer in (held, other):
        pool.give(buffer)


def test_a_buffer_is_handed_out_again_only_for_its_device():
    pool, _ = _buffers()
    first = pool.take(4 * MiB, "cuda:0")
    pool.give(first)
    assert pool.take(4 * MiB, "cuda:1").data_ptr() != first.data_ptr() and pool.made == 2
