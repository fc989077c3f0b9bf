"""The ring core's memory grows linearly with the sequence: one rank of a ring of 2 at 16K, 32K and 64K tokens.

The rank is alone in this process (tests/helpers/ring_sim.py ``EchoTransport``: each exchange returns a copy of
what it sent), so it computes and allocates what it would in a real ring of 2. ``PeakMemory`` counts every
tensor storage made inside forward + backward; the fused CPU kernel's own scratch space is per thread and
per tile, not per token pair, and is not counted.
"""

import time

import torch

from tests.helpers.ring_sim import EchoTransport
from ulysses_sp.cores import Segments
from ulysses_sp.memory import PeakMemory
from ulysses_sp.ring import ring_attention


def _peak(seq_len: int, ring: int = 2, heads: int = 1, head_dim: int = 8) -> int:
    segments = Segments.from_positions(torch.arange(seq_len)[None])
    n = seq_len // ring
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(1, n, heads, head_dim, generator=gen)
    with PeakMemory() as peak:
        ring_attention(q, k, v, segments, EchoTransport(0, ring)).backward(grad)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    return peak.peak_bytes


def test_ring_core_peak_memory_grows_linearly():
    """Peak of forward + backward at N = 16K, 32K, 64K (ring 2, so 8K-32K tokens per rank): doubling N at most
    doubles it (ratio < 2.3, where a [q, k] tensor per block would make it 4), and at 64K it stays a few
    MiB where one fp32 score block of the rank (32K x 32K) would be 4 GiB."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU kernel's backward with fewer heads than threads stalls on a busy machine
    try:
        start = time.perf_counter()
        peaks = {n: _peak(n) for n in (16384, 32768, 65536)}
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    ratios = peaks[32768] / peaks[16384], peaks[65536] / peaks[32768]
    described = f"peaks {[f'{p / 2**20:.1f} MiB' for p in peaks.values()]}, ratios {ratios}, {seconds:.0f} s"
    assert all(r < 2.3 for r in ratios), described
    assert peaks[65536] < 32 * 2**20, described
