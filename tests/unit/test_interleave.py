"""The head-chunked attention's exchanges: the scheduler that runs the chunks side by side (ulysses_sp.interleave),
and the packing of several send buffers into one all-to-all (ulysses_sp.comm.pack_rows / unpack_rows)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spy import CountOps
from ulysses_sp.comm import Joined, pack_rows, unpack_rows
from ulysses_sp.interleave import run_interleaved


def chunk(c: int, exchanges: int, log: list, in_flight: set) -> object:
    """A chunk with ``exchanges`` exchanges: each step waits for its previous one, computes (logged with whether
    another chunk's exchange was in flight meanwhile), then launches the next and yields."""
    for i in range(exchanges):
        in_flight.add((c, i))
        yield
        in_flight.discard((c, i))
        log.append((c, i, bool(in_flight)))


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("exchanges", [1, 2, 4])
def test_two_chunks_alive_each_step_behind_an_exchange(chunks: int, exchanges: int) -> None:
    log, in_flight = [], set()
    run_interleaved(chunk(c, exchanges, log, in_flight) for c in range(chunks))
    assert sorted((c, i) for c, i, _ in log) == [(c, i) for c in range(chunks) for i in range(exchanges)]
    for c in range(chunks):  # each chunk's steps in order, and chunk c+2 starts only once chunk c is done
        assert [i for d, i, _ in log if d == c] == list(range(exchanges))
        if c + 2 < chunks:
            steps = {d: [k for k, (e, *_) in enumerate(log) if e == d] for d in (c, c + 2)}
            assert steps[c][-1] < steps[c + 2][0], log
    # the forward and the fused backward (two exchanges a chunk) with C even: every step but the last overlaps (with C
    # odd the last chunk runs alone)
    if chunks > 1 and exchanges <= 2 and chunks % 2 == 0:
        assert all(busy for *_, busy in log[:-1]), log


def test_first_steps_alternate_between_two_chunks() -> None:
    log, in_flight = [], set()
    run_interleaved(chunk(c, 2, log, in_flight) for c in range(4))
    assert [(c, i) for c, i, _ in log] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def test_a_failing_chunk_closes_the_others() -> None:
    closed = []

    def tracked(c: int) -> object:
        try:
            yield
            if c == 1:
                raise ValueError("chunk 1 failed")
            yield
        finally:
            closed.append(c)

    with pytest.raises(ValueError, match="chunk 1 failed"):
        run_interleaved(tracked(c) for c in range(4))
    assert sorted(closed) == [0, 1]


def test_pack_rows_round_trips_mixed_dtypes_and_strides() -> None:
    sp = 3
    parts = [
        torch.randn(sp, 2, 5, 4).transpose(2, 3),  # a strided view
        torch.randn(sp, 7, dtype=torch.float64),
        torch.arange(sp * 3, dtype=torch.int16).view(sp, 3),  # 6 bytes a row: padded to the 8 of float64
        torch.randn(sp, 2, 3).to(torch.bfloat16),
    ]
    send, layout = pack_rows(parts)
    assert send.dtype == torch.uint8 and send.shape[0] == sp and send.is_contiguous()
    assert all(width % 8 == 0 for *_, width in layout)
    one_row = [(torch.Size((1, *shape[1:])), dtype, width) for shape, dtype, width in layout]
    for rank in range(sp):  # a rank's row of every part lies in its own row of the packed buffer
        for found, part in zip(unpack_rows(send[rank : rank + 1], one_row), parts, strict=True):
            torch.testing.assert_close(found[0], part[rank], rtol=0, atol=0)
    for found, part in zip(unpack_rows(send, layout), parts, strict=True):
        assert found.dtype == part.dtype and found.shape == part.shape
        torch.testing.assert_close(found, part, rtol=0, atol=0)


@pytest.mark.parametrize("wire", [None, torch.float64])
def test_pack_rows_writes_joined_pieces_once_into_a_buffer_of_their_dtype(wire) -> None:
    """Pieces joined along a dim go straight into their place (what torch.cat of them would be); parts of one dtype
    (or cast to one ``wire`` dtype) share a buffer of that dtype, read back as views without a byte view."""
    sp = 2
    joined = Joined((torch.randn(sp, 3, 2, 4).transpose(2, 3), torch.randn(sp, 3, 4, 1)), -1)
    plain = torch.randn(sp, 5)
    send, layout = pack_rows([joined, plain], wire)
    assert send.dtype == (wire or torch.float32) and send.shape == (sp, 3 * 4 * 3 + 5)
    first, second = unpack_rows(send, layout)
    torch.testing.assert_close(first, joined.tensor().to(send.dtype), rtol=0, atol=0)
    torch.testing.assert_close(second, plain.to(send.dtype), rtol=0, atol=0)
    assert first.untyped_storage().data_ptr() == send.untyped_storage().data_ptr()  # a view of the buffer


def test_pack_rows_makes_every_place_in_one_op_and_copies_each_piece_once() -> None:
    """What a head-chunked exchange pays per part and piece (it runs C times per layer and stage): one buffer, one
    op for all the parts' places (and one for a joined part's pieces), a view per part, one copy per piece; reading
    back, one op for all the parts and a view each (a slice and a view per part, and per piece, before)."""
    sp = 4
    joined = Joined((torch.randn(sp, 1, 8, 1, 4), torch.randn(sp, 1, 8, 1, 1)), -1)  # a gradient and its row sums
    plain = torch.randn(1, sp, 8, 4).reshape(1, sp, 1, 8, 4).transpose(0, 1)  # a chunk's q, [P, b, h, n, d]
    with CountOps() as packing:
        send, layout = pack_rows([plain, joined])
    assert packing.ops["copy_"] == 3 and sum(packing.ops.values()) <= 8, packing.ops
    with CountOps() as reading:
        first, second = unpack_rows(send, layout)
    assert sum(reading.ops.values()) <= 3, reading.ops
    torch.testing.assert_close(first, plain, rtol=0, atol=0)
    torch.testing.assert_close(second, joined.tensor(), rtol=0, atol=0)
