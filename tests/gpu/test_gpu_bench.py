"""The bench's GPU mode on a real GPU at a small planned memory (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from ulysses_sp.bench.gpu import run_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_mode_fits_at_the_planned_maximum_and_not_ten_percent_above(gpu_record):
    """Llama-3.1-8B's shape as rank 0 of sp=8, planned for a 10 GiB GPU (the allocator capped at it; about 180K
    tokens, so a step takes seconds, not the many minutes of a whole card's maximum): the step fits at the
    planner's longest sequence and not 10% above it, and the planner is within 10% where it ran."""
    results = run_gpu(models=("llama-3.1-8b",), sp_sizes=(8,), gpu_memory_bytes=10 << 30, throughput_seq_len=32768)
    gpu_record(results=results)
    points = results["models"]["llama-3.1-8b"]["layouts"]["8"]["points"]
    assert points["throughput"]["tokens_per_s"] > 0 and points["throughput"]["tflops"] > 0
    mfu = points["throughput"]["mfu"]
    assert mfu is None or 0 < mfu < 1
    assert points["max"]["fits"], points["max"]
    assert not points["over"]["fits"], points["over"]
    assert 0.9 <= points["max"]["ratio"] <= 1.1, points["max"]
